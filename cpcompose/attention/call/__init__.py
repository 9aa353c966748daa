"""One attention call from entry to result: the options, the checks and cross-rank agreement
(`orchestrate.py`), the automatic choice, the compiled custom op and the public entry points."""

__all__: list[str] = []
