"""The documentation site builds with warnings as errors, so the suite fails on a broken link, a page left out
of the navigation, or an API name the package no longer has (mkdocstrings reads the docstrings of the names
docs/reference/ lists).

`mkdocs.yml` turns every kind of warning on (`strict`, and `validation:` for omitted files, links and anchors);
this test builds the site into a temporary folder and fails with mkdocs' own lines. A second, tiny build shows
that the same settings do fail: a page with a broken link and a stale API name must be refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # the real build takes ~2-5 s; generous for a loaded machine, and a hang still fails


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _warnings(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith(("WARNING", "ERROR"))]


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0 and not _warnings(done), "mkdocs build --strict:\n" + done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "cpcompose" / "index.html").read_text().count("cpcompose.cp_attention")


def test_the_same_settings_refuse_a_broken_link_and_a_stale_api_name(tmp_path: Path) -> None:
    """The project's mkdocs settings, on a two-page site whose pages hold the mistakes the real build guards."""
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    paths = settings["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    paths["paths"] = [str(ROOT)]
    settings.update(docs_dir=str(tmp_path / "docs"), nav=["index.md", "api.md"])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: cpcompose.no_such_name\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(settings))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    shown = done.stdout + done.stderr
    assert done.returncode != 0, shown
    assert "missing.md" in shown and "no_such_name" in shown, shown
