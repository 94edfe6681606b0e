"""The DP and the non-private training loops (layer 4), and what a step trains.

`dp_fit` is the one DP loop (Poisson batches from `batching`, resumable through `resume`),
`dp_spec` turns `finetune.*` into a run, `loops` holds evaluation and the non-private SGD of
warm-up and pre-training, `strategies` which parameters a step trains, `checkpoint` the
checksummed checkpoints, `job` the harness every training job shares (seeding, one MLflow run,
an atomic `metrics.json`). Fine-tuning, HPO trials, the audit and the federated clients all
train here, so this layer may import algorithms and everything below (`per_sample`, `privacy`,
`models`, `data`, the ground floor and `tracking`), never an experiment, a stage or an entry
point.
"""
