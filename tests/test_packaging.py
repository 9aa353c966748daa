"""Packaging: a LICENSE file, an SPDX license string, the console scripts, no dead dependency markers."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_pyproject_is_valid_and_tidy() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml")["project"]  # validates against the schema
    assert project["license"] == "BSD-3-Clause"
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    module, _, name = project["scripts"]["cpcompose-train"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    raw = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in raw["dependencies"] if "python_version" in d], "requires-python >= 3.11 already"


def test_integration_extras_pin_what_the_suite_installs() -> None:
    """Each integration's extra is what the test extra installs, so CI tests the pinned release."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["torchtitan"] == ["torchtitan==0.3.0"]
    assert set(extras["hf"]) | set(extras["torchtitan"]) | set(extras["parquet"]) <= set(extras["test"])
    assert not any(d.split("=")[0].split(">")[0].strip() == "torch" for d in extras["torchtitan"]), (
        "pinning torch in an extra could pull a CUDA build; the README's command pins it instead"
    )


def test_every_console_script_is_installed() -> None:
    """The installed cpcompose has the commands pyproject.toml declares, with the same targets."""
    dist = importlib.metadata.distribution("cpcompose")
    installed = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert installed == SCRIPTS, (
        "the installed console scripts differ from pyproject.toml's: an editable install keeps the commands of "
        f"when it was made; run `pip install -e .` again (installed {sorted(installed)}, declared {sorted(SCRIPTS)})"
    )


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_answers_help(name: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's target, called as the installed wrapper calls it (`sys.argv` holds the command's name and
    its arguments; the wrapper exits with what the function returns), prints its usage and exits 0. In this
    process: on --help every target returns or leaves by SystemExit before any work."""
    module, _, function = SCRIPTS[name].partition(":")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    try:
        code = getattr(importlib.import_module(module), function)()
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None), err[-2000:]
    assert out.startswith("usage:"), out[:500]
