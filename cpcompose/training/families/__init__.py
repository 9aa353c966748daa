"""Model families: one record per family (`record.ModelFamily`), found by `model.name` (`registry.family_of`);
the trainer asks the record for everything family-specific."""

from cpcompose.training.families.record import ModelFamily, RouterLoss, TrainedModel
from cpcompose.training.families.registry import families, family_names, family_of

__all__ = ["ModelFamily", "RouterLoss", "TrainedModel", "families", "family_names", "family_of"]
