"""Where `checkpoint.export_hf` writes, and whose export a folder holds.

A relative `export_hf` lies inside the run's `job.dump_folder` (as `checkpoint.folder` does), so a
second run with another dump folder exports beside its own checkpoints instead of over the first
run's model. Each export leaves `cpcompose_export.json` naming the dump folder of the run that wrote
it; a folder that holds anything else (another run's export, or files no export wrote) is refused
before launch, never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from cpcompose.config import ConfigError, JobConfig

__all__ = ["MARKER", "check_export_folder", "export_folder", "mark_export"]

MARKER = "cpcompose_export.json"


def export_folder(config: JobConfig) -> Path | None:
    """`checkpoint.export_hf` resolved: relative paths inside `job.dump_folder`; None when unset."""
    export = config.checkpoint.export_hf
    if export is None:
        return None
    path = Path(export).expanduser()
    return path if path.is_absolute() else Path(config.job.dump_folder) / path


def _run_of(config: JobConfig) -> str:
    return str(Path(config.job.dump_folder).resolve())


def check_export_folder(config: JobConfig) -> None:
    """Refuse an export folder that holds another run's export, or files no export wrote.

    Raises:
        ConfigError: naming the folder, whose it is, and what to choose instead.
    """
    folder = export_folder(config)
    if folder is None or not folder.is_dir() or not any(folder.iterdir()):
        return
    marker = folder / MARKER
    try:
        writer = json.loads(marker.read_text()).get("dump_folder")
    except (OSError, ValueError, AttributeError):
        writer = None
    if writer == _run_of(config):
        return  # this run's own export (a resumed run exports again)
    whose = f"the export of the run in {writer}" if writer else "files no cpcompose export wrote"
    raise ConfigError(f"checkpoint.export_hf: {folder} holds {whose}, which this run would overwrite; choose "
                      "another folder (a relative path lies inside job.dump_folder), or delete it")


def mark_export(folder: Path, config: JobConfig) -> None:
    """Record in `folder` that this run (its dump folder) wrote the export there."""
    (folder / MARKER).write_text(json.dumps({"dump_folder": _run_of(config), "job": config.job.name}) + "\n")
