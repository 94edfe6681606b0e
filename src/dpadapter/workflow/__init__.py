"""The Snakemake workflow's own glue (layer 0): what the rule files read while they parse.

Which config a results folder holds (`identity`), each rule's rerun trigger (`fingerprint`)
and the rerun numbering of a job's MLflow runs (`reruns`), the Snakemake internals the workflow
reads (`snakemake_adapter`) and DVC around a run (`dvc_sync`). A parse must stay light (no
torch, Opacus or MLflow: tests/workflow/test_light_parse.py), and the settings and tracking read
these, so they live on the ground floor: they may import only the standard library and the
other layer-0 folders (`ground`, `settings`, `tracking`). The registries' catalog, which the
parse reads too, needs the registries above it and so lives in `registries`.
"""
