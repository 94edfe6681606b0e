"""The ground floor (layer 0): plain utilities every layer above stands on.

Atomic file writes (`atomic`), the device and its CUDA settings (`device`), the processes of a
multi-process job (`distributed`), the job harness every training job shares (`job`), the
summary cells and their CSV (`tables`), the main figures (`plots`), confidence intervals
(`stats`) and the JSON-schema vocabulary of a method's params (`param_schema`). They sit below
everything so that any layer may use them; in return they may import only the standard library,
third-party packages and the other ground-floor folders (`settings`, `tracking`, `workflow`,
`compat`), never a registry, a training loop or an entry point.
"""
