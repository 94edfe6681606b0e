"""What the validation and the rule files read of the registries, without importing them (layer 5).

`catalog` reads the algorithm, upstream-method and model registries' names, params schemas and
flags from `catalog.json` beside it, and rebuilds that manifest from the live registries
(`python -m dpadapter.registries.catalog --write`). Rebuilding imports `algorithms`, `models` and
`upstream`, so it sits at the experiments' layer: it may import everything below, never
`stages`, `validation` or `launch`; the features' checks (layer 5) and the validation read it.
"""
