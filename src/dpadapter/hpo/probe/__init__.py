"""The linear scaling rule in the paper's own regime (Panda et al. 2024, Sec. 4.2, Alg. 1-3):
a zero-initialised linear classifier (no bias) on frozen, precomputed features of a pre-trained
checkpoint, trained by full-batch DP-GD with heavy-ball momentum.

The backbone's forward pass is the same for every trial, grid point and seed, so it is computed
once (`features`) and hundreds of runs become small batched matrix products (`dpgd`). Full-batch
runs have a closed-form privacy loss (`privacy`). Stages (one Snakemake rule each,
`workflow/rules/hpo_probe.smk`): `features.compute`, `oracle.oracle`, `replicate.seed_run`,
`summary.run`.
"""
