"""Benchmark: the token store's build throughput, and the trainer's start-up time and peak memory per rank as
the corpus grows, with and without the store.

Corpora: .jsonl files of generated English-like documents (words of a fixed list, long-tailed lengths) of the
given sizes, written once into ``--work``. The tokenizer is the tiny model's byte-level BPE
(scripts/make_tiny_hf_model.py) unless ``--tokenizer`` names another folder or tokenizer.json.

1. Build throughput. The tokenizer's own ``encode_batch`` over the same texts, held in memory (batches of 1024,
   as the builder sends them), against building the store from the file (reading, parsing, encoding, writing).
   Both as MB of text per second and tokens per second, in total and per core (the cores this process may use).

2. Start-up and peak per rank. ``python -m cpcompose.train`` with the tiny Llama, cp = 2, 2 steps, on each
   corpus: in memory (data.store_dir unset: every rank tokenizes the corpus), and with the store (a first run
   that builds it, then the run that matters, a second one that reuses it). Wall time of the command, and the
   largest VmHWM of the ranks (read from /proc every 20 ms while they run), and the launcher's own (which
   builds the store, before the ranks start).

    python scripts/bench_data.py --work /tmp/bench-data --sizes-mib 1 64 1024 --out docs/bench/data.json
    python scripts/bench_data.py --work /tmp/bench-data --sizes-mib 0.25 --skip-in-memory   # a quick check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has "
         "context parallel attention ranks keys values sequence model training long document corpus token store "
         "memory mapped shuffle epoch window packing mixture weight river mountain history science language").split()


def tiny_model_script():
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", ROOT / "scripts" / "make_tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def timed_run(argv: list[str], timeout_s: float) -> dict:
    """Run a command; its wall time and the largest VmHWM among it and its descendants (polled every 20 ms)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            if (hwm := _hwm_kib(pid)) is not None:
                peaks[pid] = max(peaks.get(pid, 0), hwm)
        if time.perf_counter() - start > timeout_s:
            proc.kill()
        time.sleep(0.02)
    output = proc.stdout.read() if proc.stdout else ""
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{output[-3000:]}")
    ranks = sorted((v for p, v in peaks.items() if p != proc.pid), reverse=True)
    return {"seconds": seconds, "peak_per_rank_mib": (ranks[0] if ranks else peaks.get(proc.pid, 0)) / 1024,
            "launcher_peak_mib": peaks.get(proc.pid, 0) / 1024}  # the launcher builds the store before the ranks


def trainer_argv(model: Path, corpus: Path, dump: Path, store_dir: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "cpcompose.train", "--config", str(ROOT / "train_configs" / "hf_tiny_cpu.toml"),
            f"--model.path={model}", "--training.steps=2", "--data.source=text", f"--data.path={corpus}",
            f"--job.dump_folder={dump}", "--checkpoint.enable=false", "--checkpoint.export_hf=none",
            "--metrics.plot_loss=false", "--metrics.log_freq=1"]
    return argv + ([f"--data.store_dir={store_dir}"] if store_dir is not None else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpora, model and stores")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--tokenizer", help="a tokenizer folder or tokenizer.json (default: the tiny model's)")
    parser.add_argument("--throughput-mib", type=float, default=None,
                        help="corpus size for the throughput part (default: the largest of --sizes-mib, at most 64)")
    parser.add_argument("--skip-in-memory", action="store_true", help="only the store's runs")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "tiny-llama"
    if not (model / "config.json").exists():
        tiny_model_script().make_tiny_model(model)
    tokenizer = args.tokenizer or str(model)
    results: dict = {"machine": {"cores": cores(), "python": sys.version.split()[0], "torch": torch.__version__}}
    size = args.throughput_mib or min(max(args.sizes_mib), 64)
    results["throughput"] = build_throughput(write_corpus(args.work / f"corpus-{size:g}MiB.jsonl", size),
                                             tokenizer, args.work)
    print(json.dumps(results["throughput"], indent=1), flush=True)
    results["startup"] = []
    for mib in args.sizes_mib:
        corpus = write_corpus(args.work / f"corpus-{mib:g}MiB.jsonl", mib)
        row: dict = {"corpus_mib": mib}
        if not args.skip_in_memory:
            row["in_memory"] = timed_run(trainer_argv(model, corpus, args.work / "dump-mem", None), args.timeout_s)
        stores = args.work / f"stores-{mib:g}"
        shutil.rmtree(stores, ignore_errors=True)
        row["store_first_run"] = timed_run(trainer_argv(model, corpus, args.work / "dump-s1", stores), args.timeout_s)
        row["store_second_run"] = timed_run(trainer_argv(model, corpus, args.work / "dump-s2", stores), args.timeout_s)
        results["startup"].append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
