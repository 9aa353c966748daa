"""Packaging: a LICENSE file, an SPDX license string, a console script, no dead dependency markers."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_is_valid_and_tidy() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml")["project"]  # validates against the schema
    assert project["license"] == "BSD-3-Clause"
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    module, _, name = project["scripts"]["cpcompose-train"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    raw = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in raw["dependencies"] if "python_version" in d], "requires-python >= 3.11 already"
