"""The registered model families: the one place that reads `model.name`.

cpcompose's own families come from `cpcompose.models`' registry; the Hugging Face family reads a
folder. `cpcompose.models` and `cpcompose.integrations` are sibling layers that may not import each
other, so the registry lives here, in the trainer's layer, which may import both.
"""

from __future__ import annotations

from cpcompose.config import ConfigError, JobConfig
from cpcompose.models import model_names
from cpcompose.training.families.hf.record import HuggingFaceFamily
from cpcompose.training.families.own import OwnFamily
from cpcompose.training.families.record import ModelFamily

__all__ = ["families", "family_names", "family_of"]


def families() -> dict[str, ModelFamily]:
    """Every family by its `model.name`, in a fixed order: cpcompose's own, then Hugging Face's."""
    hf = HuggingFaceFamily()
    own = {name: OwnFamily(name, folder_families=(hf.name,)) for name in model_names()}
    return {**own, hf.name: hf}


def family_names() -> tuple[str, ...]:
    """Every `model.name` the trainer takes."""
    return tuple(families())


def family_of(config: JobConfig) -> ModelFamily:
    """The record of `model.name`.

    Raises:
        ConfigError: the name is not a registered family.
    """
    known = families()
    if config.model.name not in known:
        raise ConfigError(f"model.name: {config.model.name!r} is not one of {', '.join(known)}")
    return known[config.model.name]
