"""The trainer behind `python -m cpcompose.train`: the run loop, checkpoints, metrics, faults, launch and
the checks made before any rank starts. Import the modules you need; nothing is re-exported here."""

__all__: list[str] = []
