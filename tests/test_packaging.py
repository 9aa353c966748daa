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


def test_integration_extras_pin_what_the_suite_installs() -> None:
    """Each integration's extra is what the test extra installs, so CI tests the pinned release."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["torchtitan"] == ["torchtitan==0.3.0"]
    assert set(extras["hf"]) | set(extras["torchtitan"]) | set(extras["parquet"]) <= set(extras["test"])
    assert not any(d.split("=")[0].split(">")[0].strip() == "torch" for d in extras["torchtitan"]), (
        "pinning torch in an extra could pull a CUDA build; the README's command pins it instead"
    )
