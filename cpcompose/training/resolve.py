"""The resolution step: a config as the user wrote it, checked and completed by what only the trainer knows.

The config package holds and validates values; what needs a model family, its files or the data's task is
resolved here, once, by the launcher before any rank starts and by each rank's trainer (the same function, so a
config reached either way is the same): the family's refusals (what it does not take), the values its files
give (a model folder's vocabulary), and the data task's parameters.
"""

from __future__ import annotations

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.loader import data_config_error
from cpcompose.distributed.pipeline import pipeline_problem
from cpcompose.training.families import families, family_of

__all__ = ["resolve_config"]


def resolve_config(config: JobConfig, world_size: int | None = None) -> JobConfig:
    """`config` checked across its sections (against `world_size` when given), by its model family and its data
    task, and completed with the family's files: what the trainer, the plan and the dry run read.

    Idempotent: resolving a resolved config returns an equal one.

    Raises:
        ConfigError: naming the key to change.
    """
    family = family_of(config)
    if (refusal := family.refusal(config)) is not None:  # first: "this family does not take X" says most
        raise refusal
    config.validate(world_size=world_size)
    if config.checkpoint.export_hf is not None and not family.exports:
        exporting = [name for name, record in families().items() if record.exports]
        raise ConfigError("checkpoint.export_hf: writes a Hugging Face model: only with model.name = "
                          + " or ".join(f"'{n}'" for n in exporting))
    config = family.resolve(config)
    # After the family's files: model.n_layers is the model's (a family read from a folder fills it in).
    if (problem := pipeline_problem(config.parallelism, config.model.n_layers,
                                    compiled=config.training.compile)) is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")
    if (error := data_config_error(config)) is not None:
        raise error
    return config
