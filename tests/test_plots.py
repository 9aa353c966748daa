"""The benchmark pages' plots are up to date with the JSON they are drawn from, and each is shown on a page.

`scripts/plot_bench.py` records, beside the PNGs, the SHA-256 of every JSON file each plot was drawn from
(docs/bench/plots/sources.json). Here the hashes are recomputed from the JSON now in the repository, so a
benchmark JSON added or changed without rerunning the script fails, naming the command; the images themselves
are not compared (matplotlib's output differs between versions).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
RERUN = "run `python scripts/plot_bench.py` and commit docs/bench/plots/"


def _script() -> ModuleType:
    return load_script("plot_bench")


def _recorded() -> dict[str, dict]:
    return json.loads((ROOT / "docs" / "bench" / "plots" / "sources.json").read_text())


def test_every_plot_was_drawn_from_the_json_now_in_the_repository() -> None:
    now = _script().sources(ROOT)
    recorded = {name: entry["json"] for name, entry in _recorded().items()}
    assert recorded == now, f"the benchmark JSON changed since the plots were drawn: {RERUN}"


def test_every_recorded_plot_exists_and_is_shown_beside_its_table() -> None:
    plots = ROOT / "docs" / "bench" / "plots"
    recorded = _recorded()
    drawn = {name for name, entry in recorded.items() if entry["png"]}
    present = {p.name for p in plots.glob("*.png")}
    assert present == drawn, f"PNGs {sorted(present)} but sources.json says {sorted(drawn)}: {RERUN}"
    for name in drawn:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    unshown = [name for name in drawn if f"bench/plots/{name})" not in pages]
    assert not unshown, f"plots no docs page shows: {unshown}"


def test_a_changed_json_is_noticed(tmp_path: Path) -> None:
    """The check can fail: one byte more in a copy of a benchmark JSON changes what `sources` reports."""
    for folder in ("docs/bench", "docs/gpu_runs"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("plots"))
    script = _script()
    assert script.sources(tmp_path) == script.sources(ROOT)
    changed = next(iter(sorted((tmp_path / "docs" / "bench").glob("*.json"))))
    changed.write_text(changed.read_text() + " ")
    assert script.sources(tmp_path) != script.sources(ROOT)
