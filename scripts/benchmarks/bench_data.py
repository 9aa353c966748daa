"""Benchmark: the token store's build throughput, and the trainer's start-up time and peak memory per rank as
the corpus grows, with and without the store.

Corpora: .jsonl files of generated English-like documents (words of a fixed list, long-tailed lengths) of the
given sizes, written once into ``--work``. The tokenizer is the tiny model's byte-level BPE
(cpcompose/integrations/transformers/tiny_model.py) unless ``--tokenizer`` names another folder or tokenizer.json.

1. Build throughput. The tokenizer's own ``encode_batch`` over the same texts, held in memory (batches of 1024,
   as the builder sends them), against building the store from the file (reading, parsing, encoding, writing).
   Both as MB of text per second and tokens per second, in total and per core (the cores this process may use).

2. Start-up and peak per rank. ``python -m cpcompose.train`` with the tiny Llama, cp = 2, 2 steps, on each
   corpus given as data.path, the way the docs show it (no data option but data.source and data.path): the
   default token store, in the per-user cache (pointed here at ``--work``/cache through XDG_CACHE_HOME, never
   the real one): a first run that builds it, then the run that matters, a second start that reuses it,
   ``--repeats`` times, the sizes taking turns; and, unless ``--skip-in-memory``, data.store = false (every rank
   tokenizes the corpus).
   Wall time of the command, the time from its start to the first step's log line, the largest VmHWM of the
   ranks (read from /proc every 20 ms while they run), and the launcher's own (which builds the store, before
   the ranks start).

    python scripts/benchmarks/bench_data.py --work /tmp/bench-data --sizes-mib 1 64 --repeats 3 \
        --out docs/bench/data.json
    python scripts/benchmarks/bench_data.py --work /tmp/bench-data --sizes-mib 0.25 --skip-in-memory   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from common import ROOT, machine, tiny_hf_model, write_json

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has "
         "context parallel attention ranks keys values sequence model training long document corpus token store "
         "memory mapped shuffle epoch window packing mixture weight river mountain history science language").split()


def write_corpus(path: Path, mib: float, seed: int = 0) -> Path:
    """Documents of Pareto-tailed word counts (median ~150 words, some of tens of thousands) up to ``mib``."""
    if path.exists():
        return path
    g = torch.Generator().manual_seed(seed)
    target, written = int(mib * 2**20), 0
    tmp = path.with_suffix(".partial")
    with tmp.open("w") as f:
        while written < target:
            n = int(100 * (1 - torch.rand((), generator=g).item()) ** (-1 / 1.2))
            ids = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
            line = json.dumps({"text": " ".join(WORDS[i] for i in ids)}) + "\n"
            f.write(line)
            written += len(line)
    tmp.rename(path)
    return path


def cores() -> int:
    return len(os.sched_getaffinity(0))


def build_throughput(corpus: Path, tokenizer_path: str, work: Path) -> dict:
    from cpcompose.config import load_config
    from cpcompose.data import build_tokenizer
    from cpcompose.data.store import store_mixture

    tokenizer = build_tokenizer(tokenizer_path)
    texts = [json.loads(line)["text"] for line in corpus.open()]
    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1024):
        tokens += sum(len(ids) for ids in tokenizer.encode_batch(texts[i : i + 1024]))
    encode_s = time.perf_counter() - start
    del texts
    store_dir = work / "throughput-stores"
    shutil.rmtree(store_dir, ignore_errors=True)
    config = load_config(["--data.source=text", f"--data.path={corpus}", f"--data.store_dir={store_dir}",
                          f"--data.tokenizer={tokenizer_path}", "--model.vocab_size=1000000"])
    start = time.perf_counter()
    store = store_mixture(config, tokenizer, emit=None).stores[0]
    build_s = time.perf_counter() - start
    n = cores()
    return {"text_mb": text_mb, "tokens": store.num_tokens, "cores": n,
            "encode_batch": {"seconds": encode_s, "mb_per_s": text_mb / encode_s, "tokens_per_s": tokens / encode_s,
                             "tokens_per_s_per_core": tokens / encode_s / n},
            "store_build": {"seconds": build_s, "mb_per_s": text_mb / build_s,
                            "tokens_per_s": store.num_tokens / build_s,
                            "tokens_per_s_per_core": store.num_tokens / build_s / n},
            "build_over_encode": encode_s / build_s}


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def _hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def timed_run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run a command; its wall time, the time to its first step's log line, the largest VmHWM among it and its
    descendants (polled every 20 ms), and what the banner said about the token store."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:  # the first step's time is when its line arrives
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            if (hwm := _hwm_kib(pid)) is not None:
                peaks[pid] = max(peaks.get(pid, 0), hwm)
        if time.perf_counter() - start > timeout_s:
            proc.kill()
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{output[-3000:]}")
    first_step = next((t for t, line in lines if " step     1/" in line or " step 1/" in line), None)
    store = [line.strip() for _, line in lines if line.lstrip().startswith("token store of ")]
    ranks = sorted((v for p, v in peaks.items() if p != proc.pid), reverse=True)
    return {"seconds": seconds, "to_first_step_s": first_step,
            "peak_per_rank_mib": (ranks[0] if ranks else peaks.get(proc.pid, 0)) / 1024,
            "launcher_peak_mib": peaks.get(proc.pid, 0) / 1024,  # the launcher builds the store before the ranks
            "banner_store": store}


def trainer_argv(model: Path, corpus: Path, dump: Path, *, in_memory: bool = False) -> list[str]:
    """The docs' command on ``corpus``: data.source and data.path only (the default token store), or with
    data.store = false (tokenized in memory by every rank)."""
    argv = [sys.executable, "-m", "cpcompose.train", "--config", str(ROOT / "train_configs" / "hf_tiny_cpu.toml"),
            f"--model.path={model}", "--training.steps=2", "--data.source=text", f"--data.path={corpus}",
            f"--job.dump_folder={dump}", "--checkpoint.enable=false", "--checkpoint.export_hf=none",
            "--metrics.plot_loss=false", "--metrics.log_freq=1"]
    return argv + (["--data.store=false"] if in_memory else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpora, model and stores")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--tokenizer", help="a tokenizer folder or tokenizer.json (default: the tiny model's)")
    parser.add_argument("--throughput-mib", type=float, default=None,
                        help="corpus size for the throughput part (default: the largest of --sizes-mib, at most 64)")
    parser.add_argument("--skip-in-memory", action="store_true", help="only the store's runs")
    parser.add_argument("--repeats", type=int, default=1, help="second starts (and in-memory runs) per corpus")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(args.work / "tiny-llama")
    tokenizer = args.tokenizer or str(model)
    results: dict = {"machine": machine(), "load_average_before": os.getloadavg()}
    size = args.throughput_mib or min(max(args.sizes_mib), 64)
    results["throughput"] = build_throughput(write_corpus(args.work / f"corpus-{size:g}MiB.jsonl", size),
                                             tokenizer, args.work)
    print(json.dumps(results["throughput"], indent=1), flush=True)
    results["startup"] = []
    cache = args.work / "cache"  # the per-user cache of these runs (XDG_CACHE_HOME), emptied first
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    corpora = {mib: write_corpus(args.work / f"corpus-{mib:g}MiB.jsonl", mib) for mib in args.sizes_mib}
    for mib, corpus in corpora.items():
        row: dict = {"corpus_mib": mib}
        if not args.skip_in_memory:
            row["in_memory"] = [timed_run(trainer_argv(model, corpus, args.work / "dump-mem", in_memory=True),
                                          args.timeout_s, env) for _ in range(args.repeats)]
        row["store_first_run"] = timed_run(trainer_argv(model, corpus, args.work / "dump-s1"), args.timeout_s, env)
        row["store_second_runs"] = []
        results["startup"].append(row)
        print(json.dumps(row), flush=True)
    for _ in range(args.repeats):  # the runs that matter, interleaved: a burst of load on a shared machine
        for row, corpus in zip(results["startup"], corpora.values()):  # then slows every size alike
            row["store_second_runs"].append(timed_run(trainer_argv(model, corpus, args.work / "dump-s2"),
                                                      args.timeout_s, env))
            print(json.dumps({"corpus_mib": row["corpus_mib"], "second_run": row["store_second_runs"][-1]}),
                  flush=True)
    results["load_average_after"] = os.getloadavg()
    if args.out is not None:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
