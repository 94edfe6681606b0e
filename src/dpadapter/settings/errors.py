"""The error a wrong config raises, and how one problem of it is written.

A problem is one line `key: text`, the key dotted as the schema errors spell it
(`finetune.extra_grids.0.algorithms`), so `dpadapter.settings.lines.locate` and
`dpadapter.settings.problems.locate` can point it at the file and line that hold the key, and
`dpadapter.settings.problems.section_of` can tell which section of the pipeline it stands in the
way of.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


def invalid(problems: Iterable[str]) -> ConfigError:
    """The ConfigError of `key: text` problems, one indented line each."""
    return ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))


# A name a section lists that `pretrain.methods` does not.
NOT_METHOD = "{} is not in pretrain.methods"


def missing(where: str, names: Iterable[Any], known: Any, message: str) -> list[str]:
    """`where: message` (the name quoted into its `{}`) for each name that is not in `known`."""
    return [f"{where}: {message.format(repr(n))}" for n in names if n not in known]
