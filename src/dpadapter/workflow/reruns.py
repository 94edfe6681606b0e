"""A rerun's MLflow run is told apart from the run it replaces.

Snakemake reruns a job in place (a changed input, `--forcerun`, a failed attempt retried): the
new result replaces the old one at the same path, but MLflow kept both runs under one name, so
the runs table showed the same job twice with nothing to say which result is on disk. A job's
*slot* is where its result lives (the results folder, the stage and the wildcards); a new run
in a slot that already has runs is numbered (`... #2`, tag `dpadapter.attempt`), names the run
it replaces (`dpadapter.replaces`), and each earlier run of the slot is marked: its name ends in
`(replaced)` and `dpadapter.replaced_by` names the new run. A resumed run (the same attempt
continued) is not a rerun and is left as it is (`dpadapter.tracking.lifecycle.open_run`).
"""

from __future__ import annotations

from pathlib import Path

SLOT_TAG = "dpadapter.slot"
ATTEMPT_TAG = "dpadapter.attempt"
REPLACES_TAG = "dpadapter.replaces"
REPLACED_BY_TAG = "dpadapter.replaced_by"
REPLACED = " (replaced)"


def slot(results_dir: str | Path, stage: str, wildcards: dict[str, str]) -> str:
    """Where a job's result lives: the same for every attempt of the job, whatever the config.

    The folder is absolute: two projects that both write to `results/` and track into one
    server must not number each other's runs.
    """
    return "/".join([str(Path(results_dir).resolve()), stage, *map(str, wildcards.values())])


def quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def runs_tagged(client, exp_id: str, tag: str, value: str, extra: str = "") -> list:
    """Runs of `exp_id` whose `tag` is `value` (and `extra` filters), oldest first."""
    return client.search_runs(
        [exp_id],
        filter_string=f"tags.`{tag}` = {quoted(value)}{extra}",
        max_results=1000,
        order_by=["attributes.start_time ASC"],
    )


def number(
    client, exp_id: str, name: str, tags: dict[str, str]
) -> tuple[str, dict[str, str], list]:
    """(run name, tags, earlier runs of the slot) for a new run; the name and tags unchanged
    for a job's first run or a run without a slot."""
    key = tags.get(SLOT_TAG)
    earlier = runs_tagged(client, exp_id, SLOT_TAG, key) if key else []
    if not earlier:
        return name, tags, []
    attempt = 1 + max(int(r.data.tags.get(ATTEMPT_TAG, "1")) for r in earlier)
    tags = {**tags, ATTEMPT_TAG: str(attempt), REPLACES_TAG: earlier[-1].info.run_id}
    return f"{name} #{attempt}", tags, earlier


def mark_replaced(client, earlier: list, run_id: str) -> None:
    """Each earlier run of the slot not yet marked: `(replaced)` and the run that replaces it."""
    for r in earlier:
        if REPLACED_BY_TAG in r.data.tags:
            continue
        client.set_tag(r.info.run_id, REPLACED_BY_TAG, run_id)
        name = r.info.run_name or ""
        if not name.endswith(REPLACED):
            client.update_run(r.info.run_id, name=name + REPLACED)
