"""What a real pipelined trainer run holds after each pipeline action: the heap in use, rank by rank.

Runs the trainer (a tiny Llama, real tensors, gloo ranks forked by `tests/support/rank_pool.py`) and records, after
every forward "F", input backward "I" / whole backward "B" and weight backward "W" of each stage, and at each step's
end, glibc's heap in use (`mallinfo2`: uordblks + hblkhd). That figure involves no torch hook, so it says what the
run itself holds; options add torch's `FSDPMemTracker` (real mode, from the second step: torch's stage runs
`autograd.grad` on leaves at its first step, which the tracker's hooks refuse), Python's collector off, a
collection after each "W" (once, or until a pass frees nothing), or the heap's high water inside each action
(sampled after every op). docs/trainer/memory.md, "The zero-bubble split backward: what a real run holds", has the
findings. Example (the first row of its table; WORLD = pp x dp_shard x cp):

    WORLD=2 python scripts/pipeline_heap_probe.py '{"gc_off": true}'
    WORLD=4 python scripts/pipeline_heap_probe.py '{"gc_off": true, "tracker": true, "collect": "loop"}' \\
        '["--parallelism.dp_shard=2", "--training.batch_size=8"]'
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2
_PEAK = [0]


def heap() -> int:
    """Bytes glibc's allocator has handed out and not had back (small blocks and mmapped ones)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class _HighWater(TorchDispatchMode):
    """The heap's high water, sampled after every op; keeps no tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        _PEAK[0] = max(_PEAK[0], heap())
        return out


def case(mesh, args: list[str], mode: dict) -> list[tuple]:  # noqa: ANN001, ARG001 (a rank-pool case)
    """Train 3 steps on this rank; return (step, action, stage, microbatch, heap, peak or tracker total) rows."""
    from cpcompose import _compat
    from cpcompose.config import load_config
    from cpcompose.training.loop.trainer import Trainer
    from tests.support.trainer import TINY

    if mode.get("gc_off"):
        gc.disable()
    trainer = Trainer(load_config(TINY + args))
    rows: list[tuple] = []
    step = [0]
    tracker = None
    if mode.get("tracker"):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        roots = [st.submod for st in trainer.schedule._stages]
        tracker = FSDPMemTracker(roots[0], trainer.optimizer)
        _compat.track_several_roots(tracker, roots)

    def second() -> int:
        if tracker is None:
            return _PEAK[0] if mode.get("peak") else 0
        return sum(int(v) for snap in tracker._curr_mem_snap.values() for k, v in snap.items()
                   if str(getattr(k, "value", k)) == "Total")

    for st in trainer.schedule._stages:
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            def wrapped(*a, _run=getattr(st, name), _kind=kind, _st=st, **k):  # noqa: ANN002, ANN003, ANN202
                _PEAK[0] = heap()
                if mode.get("peak") and step[0] == 1:
                    with _HighWater():
                        out = _run(*a, **k)
                else:
                    out = _run(*a, **k)
                label = "I" if _kind == "B" and not k.get("full_backward", True) else _kind
                if label == "W" and mode.get("collect") == "once":
                    gc.collect()
                elif label == "W" and mode.get("collect") == "loop":
                    passes = 1
                    while gc.collect():
                        passes += 1
                    label = f"W{passes}"
                rows.append((step[0], label, _st.stage_index, a[0], heap(), second()))
                return out
            setattr(st, name, wrapped)
    train_step = trainer.train_step

    def step_and_record() -> float:
        if tracker is not None and step[0] == 1:
            tracker.__enter__()
        elif tracker is not None and step[0] > 1:
            tracker.reset_mod_stats()
        loss = train_step()
        rows.append((step[0], "END", -1, -1, heap(), second()))
        step[0] += 1
        return loss

    trainer.train_step = step_and_record
    trainer.run()
    if tracker is not None:
        tracker.__exit__(None, None, None)
    return rows


def main() -> None:
    from tests.support.rank_pool import RankPool

    mode = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    args = ["--model.n_layers=12", "--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.ffn_hidden_dim=384", "--model.vocab_size=256", "--training.seq_len=1024",
            "--training.batch_size=4", "--parallelism.pp_microbatches=4", "--training.steps=3",
            "--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.pp_schedule=ZBVZeroBubble",
            "--parallelism.pp_layers_per_stage=3", *extra]
    world = int(os.environ.get("WORLD", "2"))
    pool = RankPool(world)
    start = time.time()
    try:
        results = pool.run(case, args, mode)
    finally:
        pool.close()
    for rank, rows in list(enumerate(results))[:: max(1, world // 2)]:  # one rank of each pipeline rank
        print(f"rank {rank}")
        for s, label, stage, mb, used, other in rows:
            if s == 1 or label == "END":
                print(f"  step {s} {label:4s} stage {stage:2d} mb {mb:2d}  heap {used / 2**20:8.1f} MiB  "
                      f"{'peak' if mode.get('peak') else 'tracker'} {other / 2**20:8.1f} MiB")
    print(f"wall {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
