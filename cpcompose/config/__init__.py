"""Typed run configuration: dataclass sections, a TOML file, dotted command-line overrides.

Every section is a dataclass with a docstring under each field (torchtitan's convention), so the
code, the TOML files and ``--help`` describe the same thing. Precedence, later wins: dataclass
defaults < ``--config FILE.toml`` < ``--section.key=value``. Every mistake raises
:class:`ConfigError` whose message starts with the key to change.
"""

from cpcompose.config.cp_options import cp_options
from cpcompose.config.job_config import JobConfig
from cpcompose.config.loader import format_help, load_config
from cpcompose.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    ConfigError,
    Data,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
)

__all__ = [
    "ActivationCheckpoint", "Checkpoint", "Comm", "ConfigError", "Data", "Job", "JobConfig",
    "LRScheduler", "Metrics", "Model", "Optimizer", "Parallelism", "Training",
    "cp_options", "format_help", "load_config",
]
