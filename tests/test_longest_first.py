"""The order `make test` hands files to its workers in: longest first, every file still run."""

from longest_first import FILE_SECONDS, REPO_ROOT, longest_first


def test_every_costed_file_exists():
    """A renamed file would silently lose its place at the front of the queue."""
    assert [p for p in FILE_SECONDS if not (REPO_ROOT / p).is_file()] == []


def test_the_longest_files_go_first_and_every_file_is_kept():
    many = {f"tests/test_many.py::t{i}": False for i in range(40)}
    units = {
        "tests/test_many.py": many,
        "tests/test_few.py": {"tests/test_few.py::t": False},
        "tests/cluster/test_slurm.py": {"tests/cluster/test_slurm.py::t": False},
        "tests/workflow/test_snakemake.py": {"tests/workflow/test_snakemake.py::t": False},
    }
    order = [name for name, _ in longest_first(units)]
    assert order == [
        "tests/cluster/test_slurm.py",
        "tests/workflow/test_snakemake.py",
        "tests/test_many.py",  # unlisted: costed by its number of tests
        "tests/test_few.py",
    ]
    assert dict(longest_first(units)) == units
