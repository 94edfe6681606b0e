"""Print the uv options that make `uv pip install` see the same packages as this machine's pip.

uv does not read pip's configuration (pip.conf files, PIP_* environment variables), and on some
machines the pinned torch build is only reachable through it (a local wheel directory, file://
indexes). `pip config list` already merges every configuration file and the environment, so its
find-links / index-url / extra-index-url entries are turned into the matching uv flags. Nothing
is printed where pip has none (a cluster that takes everything from PyPI).

`--index-strategy unsafe-best-match` is pip's own behaviour (best version over all indexes);
uv's default would take a package only from the first index that lists it and miss pins that
only PyPI has.

    $(uv_pip_args.py PIP)  # PIP: the pip executable whose configuration is copied
"""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
}


def uv_args(pip_config_list: str) -> list[str]:
    """uv flags for the find-links / index entries of `pip config list` output."""
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for line in pip_config_list.splitlines():
        key, sep, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if not sep or option not in FLAGS:
            continue
        for item in shlex.split(value.strip().strip("'\"")):
            if (option, item) not in seen:
                seen.add((option, item))
                out += [FLAGS[option], item]
    return [*out, "--index-strategy", "unsafe-best-match"]


def main() -> None:
    pip = sys.argv[1] if len(sys.argv) > 1 else "pip"
    listing = subprocess.run(
        [pip, "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(shlex.join(uv_args(listing)))


if __name__ == "__main__":
    main()
