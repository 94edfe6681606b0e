"""One module per stage of the main grid, plus its summaries, figures and pages (layer 6).

What `python -m dpadapter <stage>` runs (through `launch.cli`); `checks` is the main grid's own
config checks. Entry points may import every layer; only `launch` and the validation import
them, never the library.
"""
