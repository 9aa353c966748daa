"""The run loop and its components: the trainer, checkpoints, metrics, faults, the run lock."""

__all__: list[str] = []
