"""The linear scaling rule with the whole network fine-tuned (`hpo.regime: network`): each trial,
the final run and every baseline run is one training job of a registered DP algorithm, reusing
the fine-tuning code (`runner`), one Snakemake rule per stage (`workflow/rules/hpo.smk`).

Stages in order: `plan.plan`, `trials.trial` and `trials.sweep` (per sweep), `final.fit`,
`final.final`; the baselines `baselines.random_search`, `baselines.grid_run` and
`baselines.grid_oracle` (Sec. 5.2.3); `summary.run`. Each training job is its own MLflow run
tagged `mlflow.parentRunId` = the plan's run.
"""
