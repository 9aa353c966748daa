"""Plots of the benchmark JSON for the docs' benchmark pages: `python scripts/plot_bench.py`.

Reads the JSON the benchmark scripts write, as kept in docs/bench/ (and, from GPU runs, docs/gpu_runs/), and
writes one PNG per plot into docs/bench/plots/, plus docs/bench/plots/sources.json: for each PNG, the SHA-256
of every JSON it was drawn from. tests/test_plots.py recomputes those hashes (not the images), so a JSON added
or changed without rerunning this script fails the suite, naming this command. A plot whose JSON is absent is
not drawn (and an old PNG of it is removed), so the script runs whatever subset of benchmarks exists:

* attention_dense.png, attention_packed.png: efficiency T1 / (P * T_P) against L, one line per strategy and
  split (zigzag against contiguous; the balanced document split against plain zigzag), one panel per run
  (`scripts/benchmarks/bench_attention.py [--packed]`: docs/bench/attention*.json,
  docs/gpu_runs/*attention*.json);
* mixers.png: efficiency against L per token mixer, one line per run (`scripts/benchmarks/bench_mixers.py`);
* memory.png: peak memory per rank against L, one line per option and CP degree
  (`scripts/benchmarks/bench_memory.py`: every trial it ran, docs/bench/memory*.json);
* longest.png: the longest sequence each option and CP degree fits in the per-rank budget (the same JSON);
* cuda_kernels.png: forward and backward TFLOP/s of one attention block per CUDA backend against the block's
  length (`scripts/benchmarks/bench_cuda_kernels.py`: docs/gpu_runs/*cuda_kernels*.json).

Only the standard library is imported at module level (the test imports `sources` without matplotlib).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path("docs/bench/plots")
SIDECAR = OUT / "sources.json"


@dataclass(frozen=True)
class Plot:
    """One PNG: the JSON files it is drawn from (glob patterns under the repository) and how it is drawn."""

    name: str
    patterns: tuple[str, ...]
    draw: Callable[[Any, list[tuple[Path, dict[str, Any]]]], bool]  # (figure, [(path, json)]) -> drew anything


def _machine(data: dict[str, Any]) -> str:
    """The machine a run names (a measurement names the machine it ran on), and its date."""
    m = data.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu') or m.get('machine', '?')}, {m.get('cores', '?')} cores"
    return f"{where}, torch {m.get('torch', '?')}" + (f", {m['date'][:10]}" if m.get("date") else "")


def _lengths(axis: Any, values: list[int]) -> None:
    """A log2 axis of sequence lengths, labelled at the lengths measured (no minor ticks to crowd them)."""
    axis.set_xscale("log", base=2)
    axis.minorticks_off()
    axis.set_xticks(sorted(set(values)), [f"{v:,}" for v in sorted(set(values))])


def _panels(figure: Any, count: int) -> list[Any]:
    figure.set_size_inches(7.0 * count, 4.5)
    return [figure.add_subplot(1, count, i + 1) for i in range(count)]


def _draw_attention(figure: Any, runs: list[tuple[Path, dict[str, Any]]], packed: bool) -> bool:
    runs = [(p, d) for p, d in runs if bool(d.get("config", {}).get("packed")) == packed and d.get("results")]
    for axis, (path, data) in zip(_panels(figure, len(runs)), runs):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in data["results"]:
            lines.setdefault((r["strategy"], r["layout"]), []).append((r["seq_len"], r["efficiency"]))
        for (strategy, layout), points in sorted(lines.items()):
            points.sort()
            style = "none" if packed else "-" if layout == "zigzag" else "--"  # packs: one point per pack
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle=style,
                      label=f"{strategy}, {layout}", alpha=0.8)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(xlabel="sequence length L (tokens)", ylabel="efficiency T1 / (P T_P)", ylim=(0, 1.15),
                 title=f"{path.name}: P = {data['config']['world']}\n{_machine(data)}")
        _lengths(axis, [r["seq_len"] for r in data["results"]])
        axis.legend(fontsize=7)
    return bool(runs)


def _draw_mixers(figure: Any, runs: list[tuple[Path, dict[str, Any]]]) -> bool:
    (axis,) = _panels(figure, 1)
    colors = {k: f"C{i}" for i, k in enumerate(sorted({r["kind"] for _, d in runs for r in d.get("rows", [])}))}
    for run, (path, data) in enumerate(runs):
        kinds: dict[str, list[tuple[int, float]]] = {}
        for r in data.get("rows", []):
            kinds.setdefault(r["kind"], []).append((r["seq_len"], r["efficiency"]))
        for kind, points in sorted(kinds.items()):
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="os^v"[run % 4], color=colors[kind],
                      linestyle="-" if run == 0 else ":", label=f"{kind} ({path.stem})")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    _lengths(axis, [r["seq_len"] for _, d in runs for r in d.get("rows", [])])
    top = max([1.6] + [r["efficiency"] + 0.1 for _, d in runs for r in d.get("rows", [])])
    axis.set(xlabel="sequence length L (tokens)", ylabel="efficiency T1 / (P T_P)", ylim=(0, top),
             title=f"one layer's token mixer, P = {runs[0][1].get('world', '?')}\n{_machine(runs[0][1])}")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: many runs
    return True


def _model(data: dict[str, Any], key: str) -> str:
    """A bench_memory.py model, named by its vocabulary (the table's and the budget search's are small ones)."""
    vocab = (data.get(key) or {}).get("vocab_size")
    return f"vocab {vocab:,}" if vocab else key.replace("_model", " model")


def _memory_trials(data: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Every successful trial of a bench_memory.py JSON, as option -> [(L, peak MiB per rank)]."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in data.get("fixed_length", []):
        for trial in (row.get("tiny"), row.get("run")):
            if trial and trial.get("status", "ok") == "ok" and "peak_mib" in trial:
                lines.setdefault(f"unfused, {_model(data, 'table_model')}, cp={row['cp']}", []).append(
                    (trial["seq_len"], trial["peak_mib"]))
    for row in data.get("budget", []):
        for trial in row.get("trials", []):
            if trial.get("status") == "ok":
                lines.setdefault(f"unfused, {_model(data, 'budget_model')}, cp={row['cp']}", []).append(
                    (trial["seq_len"], trial["peak_mib"]))
    vocab = _model(data.get("vocab", {}), "model")
    for row in data.get("vocab", {}).get("modes", {}).values():
        for trial in row.get("trials", []):
            if trial.get("status") == "ok":
                lines.setdefault(f"{row['mode']}, {vocab}, cp={row['cp']}", []).append(
                    (trial["seq_len"], trial["peak_mib"]))
    # A length run twice (a probe, then the measurement) keeps its larger peak: a peak is a maximum anyway.
    return {k: sorted({L: max(m for n, m in v if n == L) for L, _ in v}.items()) for k, v in lines.items()}


def _draw_memory(figure: Any, runs: list[tuple[Path, dict[str, Any]]]) -> bool:
    runs = [(p, d) for p, d in runs if _memory_trials(d)]
    for axis, (path, data) in zip(_panels(figure, len(runs)), runs):
        for option, points in sorted(_memory_trials(data).items()):
            axis.plot([p[0] for p in points], [p[1] / 1024 for p in points], marker="o", label=option)
        _lengths(axis, [p[0] for points in _memory_trials(data).values() for p in points])
        axis.set(ylim=(0, None), xlabel="sequence length L (tokens)", ylabel="peak per rank (GiB)",
                 title=f"{path.name}\n{_machine(data)}")
        axis.legend(fontsize=7)
    return bool(runs)


def _longest(data: dict[str, Any]) -> list[tuple[str, int, str, int | None]]:
    """(option, longest L under the budget, how it was found, the memory plan's longest L) from a bench_memory.py
    JSON."""
    found = [(f"unfused, {_model(data, 'budget_model')}, cp={r['cp']}", r["longest"],
              "extrapolated" if r.get("extrapolated") else "measured", None)
             for r in data.get("budget", []) if r.get("longest")]
    vocab = _model(data.get("vocab", {}), "model")
    found += [(f"{r['mode']}, {vocab}, cp={r['cp']}", r["longest"],
               "extrapolated" if r.get("extrapolated") else "measured", r.get("predicted_longest"))
              for r in data.get("vocab", {}).get("modes", {}).values() if r.get("longest")]
    return found


def _draw_longest(figure: Any, runs: list[tuple[Path, dict[str, Any]]]) -> bool:
    runs = [(p, d) for p, d in runs if _longest(d)]
    for axis, (path, data) in zip(_panels(figure, len(runs)), runs):
        bars = _longest(data)
        rows = range(len(bars))
        axis.barh([r + 0.2 for r in rows], [b[1] for b in bars], height=0.4, color="C0", label="runs (" + ", ".join(
            sorted({b[2] for b in bars})) + ")")
        axis.barh([r - 0.2 for r in rows], [b[3] or 0 for b in bars], height=0.4, color="C1", label="memory plan")
        axis.set_yticks(rows, [b[0] for b in bars], fontsize=7)
        axis.legend(fontsize=7)
        budget = data.get("vocab", {}).get("budget_mib") or (data.get("budget") or [{}])[0].get("budget_mib")
        axis.set(xscale="log", xlabel="longest sequence L (tokens)",
                 title=f"longest L at {budget / 1024:g} GiB per rank\n{_machine(data)}" if budget else _machine(data))
    return bool(runs)


def _draw_cuda_kernels(figure: Any, runs: list[tuple[Path, dict[str, Any]]]) -> bool:
    path, data = runs[-1]
    rows = [r for r in data.get("results", []) if r["dtype"] == "bfloat16" and r["causal"]]
    if not rows:
        return False
    heads = max((r["heads"], r["kv_heads"], r["head_dim"]) for r in rows)
    rows = [r for r in rows if (r["heads"], r["kv_heads"], r["head_dim"]) == heads]
    for axis, phase in zip(_panels(figure, 2), ("fwd", "bwd")):
        for backend in sorted({r["backend"] for r in rows}):
            points = sorted((r["seq"], r[f"{phase}_tflops"]) for r in rows if r["backend"] == backend)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=backend)
        _lengths(axis, [r["seq"] for r in rows])
        axis.set(xlabel="block length (tokens)", ylabel="TFLOP/s",
                 title=f"{phase}, bf16 causal, {heads[0]}/{heads[1]} heads of {heads[2]}\n{_machine(data)}")
        axis.legend(fontsize=7)
    return True


PLOTS = (
    Plot("attention_dense.png", ("docs/bench/attention*.json", "docs/gpu_runs/*attention*.json"),
         lambda f, runs: _draw_attention(f, runs, packed=False)),
    Plot("attention_packed.png", ("docs/bench/attention*.json", "docs/gpu_runs/*attention*.json"),
         lambda f, runs: _draw_attention(f, runs, packed=True)),
    Plot("mixers.png", ("docs/bench/mixers*.json",), _draw_mixers),
    Plot("memory.png", ("docs/bench/memory*.json", "docs/gpu_runs/*memory*.json"), _draw_memory),
    Plot("longest.png", ("docs/bench/memory*.json", "docs/gpu_runs/*memory*.json"), _draw_longest),
    Plot("cuda_kernels.png", ("docs/gpu_runs/*cuda_kernels*.json",), _draw_cuda_kernels),
)


def inputs(plot: Plot, root: Path = ROOT) -> list[Path]:
    """The JSON files a plot is drawn from, in a fixed order."""
    return sorted({p for pattern in plot.patterns for p in root.glob(pattern)})


def sources(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """Each plot that has JSON to draw from -> {JSON path: SHA-256}: what sources.json must hold."""
    found = {}
    for plot in PLOTS:
        files = inputs(plot, root)
        if files:
            found[plot.name] = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return found


def _draws(plt: Any, plot: Plot, run: tuple[Path, dict[str, Any]]) -> bool:
    """Whether a plot can draw this one JSON: a file of another shape that the plot's patterns also match (another
    benchmark's, or an older version of its script's) is left out with a line saying so, not a crash."""
    figure = plt.figure()
    try:
        plot.draw(figure, [run])
        return True
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        print(f"{plot.name}: left out {run[0].name}, which is not in the shape it reads ({type(e).__name__}: {e})")
        return False
    finally:
        plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    root = parser.parse_args().root
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    out = root / OUT
    out.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, dict[str, str]] = {}
    wanted = sources(root)
    for plot in PLOTS:
        target = out / plot.name
        runs = [run for run in ((p, json.loads(p.read_text())) for p in inputs(plot, root)) if _draws(plt, plot, run)]
        figure = plt.figure()
        made = bool(runs) and plot.draw(figure, runs)
        if made:
            figure.tight_layout()
            figure.savefig(target, dpi=90, bbox_inches="tight", metadata={"Software": None})
            drawn[plot.name] = wanted[plot.name]
            print(f"wrote {target.relative_to(root)} from {len(runs)} JSON file(s)")
        else:
            target.unlink(missing_ok=True)
            print(f"skipped {plot.name}: no JSON with its data ({', '.join(plot.patterns)})")
        plt.close(figure)
    # A plot with JSON that holds none of its data is recorded too (with no PNG), so the test sees it was run.
    (root / SIDECAR).write_text(json.dumps({name: {"png": name in drawn, "json": hashes}
                                            for name, hashes in wanted.items()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SIDECAR}")


if __name__ == "__main__":
    main()
