"""The ground floor (layer 0): plain utilities every layer above stands on.

Atomic file writes (`atomic`), the device and its CUDA settings (`device`), the processes of a
multi-process job (`distributed`), the summary cells and their CSV (`tables`), the main figures
(`plots`), confidence intervals (`stats`) and the JSON-schema vocabulary of a method's params
(`param_schema`). They sit below everything, the config's own folder included, so that any
layer may use them; in return they import nothing of the package but each other: only the
standard library and third-party packages.
"""
