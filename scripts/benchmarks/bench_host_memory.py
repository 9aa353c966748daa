"""Benchmark: a CPU rank's resident peak over many steps against the memory plan, and the step time, per setting.

Each measurement is `python -m cpcompose.train` (the launcher, as a user starts it) from a checkout, in a
fresh environment without glibc allocator variables unless the setting adds them. The trainer's own log gives
the plan (the banner's predicted peak), each step's wall time and each step's peak resident set (VmHWM, max over
the ranks, as it grows). The CPU time of all the ranks comes from the launcher's children.

Settings:
  after        this checkout: glibc's defaults, fused AdamW.
  after+heap   this checkout with the heap settings the launcher used to set (MALLOC_MMAP_THRESHOLD_ and
               MALLOC_TRIM_THRESHOLD_ at 4 GiB: every tensor from the heap, nothing given back).
  before       `--before CHECKOUT` (a worktree of the previous commit): its launcher set those heap settings
               itself, and AdamW ran per parameter (for-loop).

Cases:
  parameters   issue 36's parameter-dominated Llama: dim 1024, 2 layers, a 128,256-token vocabulary, bfloat16,
               cp = 2, 2,048 tokens a sequence, batch 1 (0.27 B parameters; the peak is the backward's end).
  main-job     train_configs/debug_cpu.toml (the README's main job), fewer steps.
  fine-tune    train_configs/hf_tiny_cpu.toml on the tiny Llama cpcompose/integrations/transformers/tiny_model.py writes.

The settings take turns within each repeat, so a machine that slows down slows each alike.

    git worktree add /tmp/cpcompose-before <previous commit>
    python scripts/benchmarks/bench_host_memory.py --before /tmp/cpcompose-before --repeats 3 \
        --out docs/bench/host_memory.json
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, markdown_header, markdown_row, tiny_hf_model, write_json

HEAP = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
CASES = {
    "parameters": ["--config", "train_configs/debug_cpu.toml", "--model.dim=1024", "--model.n_layers=2",
                   "--model.vocab_size=128256", "--training.mixed_precision=bfloat16", "--training.seq_len=2048",
                   "--training.batch_size=1", "--training.steps=6"],
    "main-job": ["--config", "train_configs/debug_cpu.toml", "--training.steps=60"],
    "fine-tune": ["--config", "train_configs/hf_tiny_cpu.toml", "--training.steps=60"],
}
COMMON = ["--checkpoint.enable=false", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
          "--metrics.plot_loss=false"]
_STEP = re.compile(r"step +(\d+)/\d+ .* ([\d.]+) s/step +peak ([\d,]+) MiB")
_PLAN = re.compile(r"predicted peak ([\d.]+) GiB")


def run(checkout: Path, case: str, env_extra: dict[str, str], work: Path) -> dict:
    """One run of `case` from `checkout`: the plan, and per step its wall time and the peak so far."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_extra, PYTHONPATH=str(checkout))
    args = [*CASES[case], *COMMON, f"--job.dump_folder={tempfile.mkdtemp(dir=work)}"]
    if case == "fine-tune":
        args.append(f"--model.path={work / 'tiny-llama'}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cpcompose.train", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=3600, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{case} in {checkout} failed: {done.stderr[-1500:]}")
    plan = _PLAN.search(done.stdout)
    steps = [(int(s), float(t), float(p.replace(",", ""))) for s, t, p in _STEP.findall(done.stdout)]
    return {"plan_mib": float(plan.group(1)) * 1024 if plan else None, "step_s": [t for _, t, _ in steps],
            "peak_mib": [p for _, _, p in steps], "wall_s": round(wall, 1),
            "cpu_user_s": round(after.ru_utime - before.ru_utime, 1),
            "cpu_sys_s": round(after.ru_stime - before.ru_stime, 1)}


def summary(runs: list[dict]) -> dict:
    """Over repeats: the plan, the last step's peak (the most), peak / plan, the median step (the first left out)."""
    plan = runs[0]["plan_mib"]
    peaks = [r["peak_mib"][-1] for r in runs]
    steps = [t for r in runs for t in r["step_s"][1:]]
    return {"plan_mib": plan, "first_step_peak_mib": max(r["peak_mib"][0] for r in runs), "peak_mib": max(peaks),
            "peak_over_plan": round(max(peaks) / plan, 3) if plan else None,
            "median_step_s": round(statistics.median(steps), 3), "cpu_sys_s": [r["cpu_sys_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="a checkout of the previous code (its launcher's own settings)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cpcompose-bench-host-memory")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if "fine-tune" in a.cases:
        tiny_hf_model(a.work / "tiny-llama")
    settings = {"after": (ROOT, {}), "after+heap": (ROOT, HEAP)}
    if a.before is not None:
        settings["before"] = (a.before.resolve(), {})
    raw: dict[str, dict[str, list[dict]]] = {c: {s: [] for s in settings} for c in a.cases}
    for repeat in range(a.repeats):
        for case in a.cases:
            for name, (checkout, env) in settings.items():
                got = run(checkout, case, env, a.work)
                raw[case][name].append(got)
                print(f"repeat {repeat + 1} {case:<10} {name:<10} plan {got['plan_mib']:,.0f} MiB  peaks "
                      f"{got['peak_mib'][0]:,.0f} -> {got['peak_mib'][-1]:,.0f} MiB  steps "
                      f"{statistics.median(got['step_s'][1:]):.2f} s  sys {got['cpu_sys_s']} s", flush=True)
    table = {case: {name: summary(runs) for name, runs in by.items()} for case, by in raw.items()}
    print("\n" + markdown_header(["case", "setting", "plan (MiB)", "peak, step 1", "peak, last step", "peak / plan",
                                  "median step (s)"], left=("case", "setting")))
    for case, by in table.items():
        for name, s in by.items():
            print(markdown_row([case, name, f"{s['plan_mib']:,.0f}", f"{s['first_step_peak_mib']:,.0f}",
                                f"{s['peak_mib']:,.0f}", f"{s['peak_over_plan']:.2f}", f"{s['median_step_s']:.2f}"]))
    if a.out is not None:
        write_json(a.out, {"machine": machine(), "cases": CASES, "summary": table, "runs": raw})


if __name__ == "__main__":
    main()
