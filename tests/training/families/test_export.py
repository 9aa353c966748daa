"""`checkpoint.export_hf`: a relative folder lies inside the run's dump folder; another run's export is refused.

Before, hf_tiny_cpu.toml's fixed export path let a second run with another --job.dump_folder overwrite
the first run's exported model without a word.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.config import ConfigError, load_config
from cpcompose.training.families.export import MARKER, check_export_folder, export_folder, mark_export


def _config(dump: Path, export: str | None):
    # model.path must look like a model folder (it is not read here)
    (dump.parent / "config.json").write_text('{"model_type": "llama", "vocab_size": 320}')
    args = ["--model.name=hf", f"--model.path={dump.parent}", f"--job.dump_folder={dump}"]
    return load_config(args + ([f"--checkpoint.export_hf={export}"] if export is not None else []))


def test_a_relative_export_lies_inside_the_dump_folder(tmp_path: Path) -> None:
    assert export_folder(_config(tmp_path / "run", "hf")) == tmp_path / "run" / "hf"
    assert export_folder(_config(tmp_path / "run", str(tmp_path / "elsewhere"))) == tmp_path / "elsewhere"
    assert export_folder(_config(tmp_path / "run", None)) is None


def test_another_runs_export_is_refused_and_this_runs_is_not(tmp_path: Path) -> None:
    shared = str(tmp_path / "shared")
    first, second = _config(tmp_path / "one", shared), _config(tmp_path / "two", shared)
    check_export_folder(first)  # absent: fine
    Path(shared).mkdir()
    check_export_folder(first)  # empty: fine
    (Path(shared) / "model.safetensors").write_bytes(b"")
    mark_export(Path(shared), first)
    check_export_folder(first)  # its own export: a resumed run writes it again
    with pytest.raises(ConfigError, match=r"checkpoint.export_hf: .*shared holds the export of the run in .*one"):
        check_export_folder(second)
    (Path(shared) / MARKER).unlink()
    with pytest.raises(ConfigError, match=r"holds files no cpcompose export wrote.*choose another folder"):
        check_export_folder(first)
