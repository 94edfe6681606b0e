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

# seconds per file, rounded; the files above ~5 s
FILE_SECONDS = {
    "tests/workflow/test_snakemake.py": 160,
    "tests/cluster/test_slurm.py": 150,
    "tests/cluster/test_dvc.py": 95,
    "tests/cluster/test_mlflow_load.py": 60,
    "tests/stages/test_external_finetune.py": 60,
    "tests/test_tracking.py": 60,
    "tests/workflow/test_experiments.py": 55,
    "tests/stages/test_finetune.py": 55,
    "tests/bench/test_gpu_table2.py": 42,
    "tests/hpo/test_hpo_workflow.py": 40,
    "tests/train/test_batching.py": 35,
    "tests/audit/test_audit_run.py": 33,
    "tests/cluster/test_slurm_groups.py": 30,
    "tests/bench/test_gpu_smoke.py": 29,
    "tests/audit/test_audit_workflow.py": 25,
    "tests/test_config_overlay.py": 25,
    "tests/cluster/test_resume_sigkill.py": 22,
    "tests/federated/test_workflow.py": 20,
    "tests/train/test_resume_sigkill_pretrain.py": 17,
    "tests/strategies/test_phase_switch_modes.py": 16,
    "tests/hpo/test_network_pipeline.py": 16,
    "tests/test_config_errors.py": 15,
    "tests/privacy/test_accounting.py": 14,
    "tests/train/test_precision.py": 14,
    "tests/federated/test_rule_validity.py": 14,
    "tests/test_config_corpus.py": 12,
    "tests/strategies/test_strategy_phases.py": 12,
    "tests/privacy/test_calibration_bounds.py": 11,
    "tests/train/test_resume.py": 9,
    "tests/models/test_frozen_batchnorm.py": 9,
    "tests/train/test_per_sample_self_test.py": 9,
    "tests/stages/test_paper_readings.py": 9,
    "tests/test_device.py": 8,
    "tests/algorithms/test_privacy_suite.py": 7,
    "tests/cluster/test_slurm_profile.py": 7,
    "tests/algorithms/test_resume_placement.py": 6,
    "tests/strategies/test_strategies.py": 5,
    "tests/workflow/test_fingerprint.py": 5,
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
