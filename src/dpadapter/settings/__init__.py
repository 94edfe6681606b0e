"""Typed, frozen views of `config.yaml`, and the files they are read from.

- `sections`: the main grid's sections (data, model, SGD, privacy, fine-tuning, tracking,
  sweeps), each checking itself; `hpo`, `federated`, `audit`, `reference`: the feature
  sections, one module each; `compose`: the whole `Config`, `from_dict` and `load`.
- `files`: reading a file, the overlay language (`base:`, `unset:`), merging, duplicate keys
  (its docstring weighs Snakemake's own merging and config libraries); `lines`: the file and
  line of each key, and errors pointed at them; `schema`: the JSON schema and its errors, one
  line per key; `errors`: `ConfigError` and how a problem is written; `grid`: the one
  expansion of a job grid.

This package imports no registry (the registries import its dataclasses): the checks that need
them are each feature's own (`dpadapter.<feature>.checks`), composed by
`dpadapter.validation.compose`.

The config's own layer (0): the settings may import only the standard library and the other
ground-floor folders (`ground`, `workflow`), so the workflow reads them at parse time.
"""

from dpadapter.settings.audit import AuditConfig
from dpadapter.settings.compose import DEFAULT_METHODS, Config, from_dict, load
from dpadapter.settings.errors import ConfigError
from dpadapter.settings.federated import FederatedConfig, FedMechanismConfig
from dpadapter.settings.files import (
    BASE_KEY,
    MERGED_FILE,
    UNSET_KEY,
    config_chain,
    key_lines,
    merge,
    read_chain,
    read_files,
    read_raw,
    shown_path,
    uses_base,
    write_merged,
)
from dpadapter.settings.hpo import HPOConfig
from dpadapter.settings.reference import ReferenceCell, ReferenceConfig
from dpadapter.settings.schema import base_schema, validate_raw
from dpadapter.settings.sections import (
    RANDOMNESS,
    RECIPE_KEYS,
    STRATEGY_SEP,
    DataConfig,
    FinetuneConfig,
    GridConfig,
    ModelConfig,
    ParamsFor,
    PrivacyConfig,
    RobustnessConfig,
    SGDConfig,
    SplitConfig,
    SweepConfig,
    TrackingConfig,
    join_folder,
    split_folder,
)

__all__ = [
    "BASE_KEY",
    "DEFAULT_METHODS",
    "MERGED_FILE",
    "RANDOMNESS",
    "RECIPE_KEYS",
    "STRATEGY_SEP",
    "UNSET_KEY",
    "AuditConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "FedMechanismConfig",
    "FederatedConfig",
    "FinetuneConfig",
    "GridConfig",
    "HPOConfig",
    "ModelConfig",
    "ParamsFor",
    "PrivacyConfig",
    "ReferenceCell",
    "ReferenceConfig",
    "RobustnessConfig",
    "SGDConfig",
    "SplitConfig",
    "SweepConfig",
    "TrackingConfig",
    "base_schema",
    "config_chain",
    "from_dict",
    "key_lines",
    "load",
    "merge",
    "read_chain",
    "read_files",
    "read_raw",
    "join_folder",
    "shown_path",
    "split_folder",
    "uses_base",
    "validate_raw",
    "write_merged",
]
