"""`--dist loadfile` with the longest test files handed out first (the `make test` command).

xdist hands whole files to the two workers in the order of how many tests each file holds, so
the few files that take minutes with one or two tests (a Slurm cluster, a DVC round trip, the
tiny pipeline end to end) came last and ran one after another while the other worker sat idle.
Handing out the longest first lets the many short files fill in around them, so both workers
finish together. The costs below are seconds measured per file (`pytest --durations`, 2
workers); a file not listed is costed by its number of tests. A stale figure only changes the
order files start in, never which tests run or what they check.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# seconds per file, rounded; the files above ~5 s (a junit report of `make test`, session 10)
FILE_SECONDS = {
    "tests/workflow/test_external_only.py": 134,  # measured alone (issue 36): run, report, rerun
    "tests/bench/test_gpu_session.py": 85,  # 72 s set-up in CI (b7b19f1) + the compiled step
    "tests/per_sample/test_compiled.py": 130,  # alone, rules compiled too (2026-11-28, 8f4290b)
    "tests/cluster/test_slurm.py": 90,
    "tests/workflow/test_snakemake.py": 78,
    "tests/cluster/test_dvc.py": 59,
    "tests/cluster/test_mlflow_load.py": 49,
    "tests/workflow/test_dpsat_table3.py": 100,  # alone, loaded; the whole run since h36
    "tests/launch/test_supervise.py": 36,  # alone, loaded (h36)
    "tests/workflow/test_carry_over.py": 26,  # alone, loaded (h36)
    "tests/tracking/test_tracking.py": 37,
    "tests/bench/test_gpu_table2.py": 33,
    "tests/workflow/test_experiments.py": 31,
    "tests/cluster/test_slurm_groups.py": 25,
    "tests/cluster/test_resume_sigkill.py": 23,
    "tests/cluster/test_table_over_allocations.py": 30,  # alone, loaded (27-35 s; issue 44)
    "tests/train/test_resume_sigkill_pretrain.py": 22,
    "tests/stages/test_external_finetune.py": 20,
    "tests/audit/test_audit_workflow.py": 19,
    "tests/algorithms/test_privacy_suite.py": 19,
    "tests/stages/test_lean_imports.py": 18,
    "tests/bench/test_gpu_paper_timing.py": 18,  # measured alone, session 11
    "tests/launch/test_prefork.py": 17,
    "tests/settings/test_config_overlay.py": 15,
    "tests/workflow/test_fingerprint.py": 13,
    "tests/train/test_batching.py": 13,
    "tests/stages/test_finetune.py": 13,
    "tests/validation/test_config_corpus.py": 11,
    "tests/hpo/test_network_pipeline.py": 7,
    "tests/federated/test_rule_validity.py": 7,
    "tests/federated/test_workflow.py": 30,  # the federated target end to end: 20 s alone
    "tests/bench/test_gpu_smoke.py": 7,
    "tests/privacy/test_accounting.py": 7,
    # three real snakemake runs of a two-rule workflow
    "tests/workflow/test_snakemake_adapter.py": 7,
    "tests/hpo/test_hpo_workflow.py": 6,
    "tests/per_sample/test_precision.py": 6,
    "tests/per_sample/test_bookkeeping.py": 5,
    "tests/compat/test_torchvision_ops.py": 5,
}

SECONDS_PER_UNLISTED_TEST = 0.3


def file_cost(path: str, n_tests: int) -> float:
    return FILE_SECONDS.get(path, SECONDS_PER_UNLISTED_TEST * n_tests)


def longest_first(units: dict[str, dict]) -> list[tuple[str, dict]]:
    """xdist's work units (file -> its tests), the costliest first; ties keep their order."""
    return sorted(units.items(), key=lambda u: -file_cost(u[0], len(u[1])))


def make_scheduler(config, log):
    """A loadfile scheduler whose queue of files is sorted by `file_cost`, longest first."""
    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirst(LoadFileScheduling):
        _sorted = False

        def _assign_work_unit(self, node) -> None:
            if not self._sorted:  # the queue is complete before the first unit is handed out
                units = longest_first(self.workqueue)
                self.workqueue.clear()
                self.workqueue.update(units)
                self._sorted = True
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)
