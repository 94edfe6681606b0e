"""The config validation (layer 6): every feature's checks composed, before any job starts.

`compose` checks a config against every registry and composes each feature's own
`<feature>.checks`; `optional_sections` scopes the problems of the optional sections (hpo,
federated, sweeps, audit) to the targets that need them. Only these two may import several
features' checks, and since they read every registry they sit at the top, beside the entry
points: they may import any layer, and only entry points (`launch`, `stages`, a package's
`cli`) and the rule files import them.
"""
