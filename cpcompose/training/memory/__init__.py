"""Memory: the plan, the budget, the measured process, the OOM guard and the full-size rehearsal."""

__all__: list[str] = []
