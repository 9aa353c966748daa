"""What runs before any rank exists (and starts them): checks, the dry run, the local launcher."""

__all__: list[str] = []
