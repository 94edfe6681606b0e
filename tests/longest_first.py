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

# seconds per file, rounded, the files of 5 s or more: summed `--durations` of two quiet
# in-tree runs of the whole suite (2026-11-27, 2 workers): 3bc0784's for the files this
# session left alone, 5775eab's for those it changed (later changes noted)
FILE_SECONDS = {
    "tests/cluster/test_slurm.py": 137,
    "tests/workflow/test_dpsat_table3.py": 118,
    "tests/workflow/test_external_only.py": 86,
    "tests/bench/test_gpu_session.py": 78,
    "tests/workflow/test_snakemake.py": 76,
    "tests/algorithms/test_privacy_suite.py": 68,
    "tests/cluster/test_mlflow_load.py": 67,
    "tests/test_tracking.py": 52,
    "tests/cluster/test_dvc.py": 50,
    "tests/test_prefork.py": 42,
    "tests/distributed/test_ddp_pipeline.py": 37,
    "tests/distributed/test_ddp_cli.py": 35,  # 47 s before its jobs forked; 31 s alone after
    "tests/stages/test_external_finetune.py": 31,
    "tests/cluster/test_table_over_allocations.py": 30,
    "tests/train/test_batching.py": 29,
    "tests/workflow/test_experiments.py": 24,
    "tests/cluster/test_slurm_groups.py": 24,
    "tests/per_sample/test_precision.py": 24,
    "tests/stages/test_finetune.py": 24,
    "tests/bench/test_gpu_table2.py": 22,
    "tests/distributed/test_ddp.py": 22,  # 96 s at 3bc0784: nine torchrun launches, now two
    "tests/stages/test_lean_imports.py": 21,
    "tests/test_config_overlay.py": 20,
    "tests/train/test_resume_sigkill_pretrain.py": 19,
    "tests/cluster/test_resume_sigkill.py": 18,
    "tests/test_supervise.py": 17,
    "tests/bench/test_ddp_step.py": 15,
    "tests/bench/test_accountant_memo.py": 15,
    "tests/workflow/test_fingerprint.py": 15,
    "tests/test_config_corpus.py": 14,
    "tests/models/test_pretrain_dpfl_nets.py": 13,
    "tests/bench/test_gpu_smoke.py": 13,
    "tests/hpo/test_network_pipeline.py": 13,
    "tests/privacy/test_planted_memo.py": 12,
    "tests/stages/test_paired.py": 11,
    "tests/privacy/test_accounting.py": 10,  # one 14.6 s test of it cut to 3 s later
    "tests/compat/test_torchvision_ops.py": 10,
    "tests/test_overlay_sections.py": 9,
    "tests/workflow/test_carry_over.py": 9,
    "tests/hpo/test_recipe.py": 9,
    "tests/per_sample/test_hooks_channels_last.py": 8,
    "tests/privacy/test_randomness.py": 8,
    "tests/federated/test_rule_validity.py": 8,
    "tests/audit/test_audit_workflow.py": 8,
    "tests/cluster/test_slurm_profile.py": 7,
    "tests/test_snakemake_adapter.py": 7,
    "tests/per_sample/test_independence.py": 7,
    "tests/algorithms/test_resume_placement.py": 6,
    "tests/algorithms/test_bookkeeping_algorithms.py": 6,
    "tests/hpo/test_hpo_workflow.py": 6,
    "tests/privacy/test_calibration_bounds.py": 6,
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
