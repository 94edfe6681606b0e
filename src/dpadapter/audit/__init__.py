"""Empirical privacy audit: a measured lower bound on epsilon for every registered algorithm.

`bound` is the statistics (Steinke, Nasr & Jagielski 2023), `canaries` one audited run through
the library's `dp_fit` (dpadapter.train.dp_fit), `stage` the grid and the summary table, `cli`
the entry points of `workflow/rules/audit.smk`. See docs/audit.md.

Layer 5 (an experiment built on the loops): it may import `train` and everything below, and
the other experiments of its layer (`federated`), never a stage or an entry point.
"""
