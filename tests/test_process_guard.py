"""The check behind the two tiers (tests/process_guard.py): inside a guarded test every way of
starting a process fails it, naming the marker to add, even when the code under test swallows
the refusal or starts the process from a thread; a `slow` or `process` test is not guarded.

Each case runs in a guard of its own, nested in this test's: a refusal is what the case expects,
and a start the guard missed would be a real process (a forked child leaves at once)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading

import process_guard
import pytest


def _fork() -> None:
    if os.fork() == 0:  # reached only if the guard missed it
        os._exit(0)


def _mp(method: str):
    def start() -> None:
        ctx = multiprocessing.get_context(method)
        ctx.Process(target=int).start()

    return start


STARTS = {
    "subprocess.run": lambda: subprocess.run(["true"], check=True),
    "os.popen": lambda: os.popen("true").read(),
    "os.system": lambda: os.system("true"),
    "os.fork": _fork,
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
    "multiprocessing fork": _mp("fork"),
    "multiprocessing spawn": _mp("spawn"),
    "multiprocessing forkserver": _mp("forkserver"),
}


@pytest.mark.parametrize("how", sorted(STARTS))
def test_every_way_of_starting_a_process_fails_the_test_naming_the_marker(how):
    with pytest.raises(pytest.fail.Exception, match=r"some::test started a process") as e:
        with process_guard.guarding("some::test"):
            STARTS[how]()
    assert "@pytest.mark.process" in str(e.value) and "make check" in str(e.value)


def test_a_refusal_the_code_under_test_swallows_still_fails_it():
    with pytest.raises(pytest.fail.Exception, match=r"subprocess.Popen: git status"):
        with process_guard.guarding("some::test"):
            try:
                subprocess.run(["git", "status"], capture_output=True)
            except BaseException:  # noqa: BLE001  (what a careless helper might do)
                pass


def test_a_process_started_from_a_thread_fails_the_test():
    errors = []

    def job():
        try:
            subprocess.run(["true"])
        except BaseException as e:  # noqa: BLE001  (kept for the assertion below)
            errors.append(e)

    with pytest.raises(pytest.fail.Exception, match="started a process"):
        with process_guard.guarding("some::test"):
            t = threading.Thread(target=job)
            t.start()
            t.join()
    assert errors  # refused there too


def test_only_the_named_once_per_process_lookups_pass():
    """A lookup a library keeps for the process passes from its own function only."""
    path, name = process_guard.ONCE_PER_PROCESS[0]

    def define(filename: str):
        namespace: dict = {}
        code = f"def {name}(start):\n    return start()\n"
        exec(compile(code, filename, "exec"), namespace)
        return namespace[name]

    # the library's caller: allowed (`true` really runs)
    library = define(os.path.join(os.sep, "site-packages", path))
    with process_guard.guarding("some::test"):
        assert library(lambda: subprocess.run(["true"]).returncode) == 0
    # the same name anywhere else: refused
    imitation = define(os.path.join(os.sep, "elsewhere", "git_context_helpers.py"))
    with pytest.raises(pytest.fail.Exception, match="started a process"):
        with process_guard.guarding("some::test"):
            imitation(lambda: subprocess.run(["true"]))


@pytest.mark.slow
def test_a_slow_test_is_in_the_full_tier_only_and_unguarded(request):
    """Runs in `make test` only; its processes (the end-to-end `slow` tests) are allowed."""
    assert process_guard.in_full_tier_only(request.node) and not process_guard._guarded
    assert subprocess.run(["true"]).returncode == 0


def test_this_test_is_guarded(request):
    assert not process_guard.in_full_tier_only(request.node)
    with pytest.raises(pytest.fail.Exception, match="test_this_test_is_guarded started"):
        subprocess.run(["true"])
    process_guard._guarded[-1][1].clear()  # the refusal was expected: not a failure of this test
