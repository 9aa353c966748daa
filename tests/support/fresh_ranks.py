"""Ranks in fresh interpreters, each with its own PYTHONHASHSEED, for order-of-collectives tests.

The rank pools (`rank_pool.py`) fork from the pytest process, so every rank inherits the
same hash seed and the same object addresses: a collective whose order depends on a set
or a hash looks deterministic there. These ranks are new interpreters started with
`subprocess` (no fork), each with the hash seed it is given, so string hashes and the
addresses that `id()`-based hashes (torch dtypes) use differ between ranks as they do
under torchrun. A case is a module-level function `fn(mesh) -> JSON-able`, named
"module:function"; each rank's return value comes back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT_S = 60  # a collective waiting longer fails instead of hanging
CHILD = "from tests.support.fresh_ranks import child_main; child_main()"


def run_fresh(case: str, groups: list[list[int]], *, timeout: float = 240.0) -> list[list[object]]:
    """Run `case` in each group at once; group g's rank r is a fresh interpreter with PYTHONHASHSEED=groups[g][r].

    Returns:
        Per group, each rank's result.

    Raises:
        AssertionError: with every failing rank's stderr.
    """
    with tempfile.TemporaryDirectory(prefix="cpcompose-fresh-") as tmp:
        procs = {(g, r): _start(case, r, len(seeds), seed, Path(tmp, f"group{g}"))
                 for g, seeds in enumerate(groups) for r, seed in enumerate(seeds)}
        errors = []
        for (g, r), proc in procs.items():
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"--- group {g} rank {r} (PYTHONHASHSEED={groups[g][r]}, exit {proc.returncode}) ---"
                              f"\n{err}")
        assert not errors, "a fresh rank failed:\n" + "\n".join(errors)
        return [[json.loads(Path(tmp, f"group{g}", f"rank{r}.json").read_text()) for r in range(len(seeds))]
                for g, seeds in enumerate(groups)]


def _start(case: str, rank: int, world: int, seed: int, folder: Path) -> subprocess.Popen:
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": str(seed),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [case, str(rank), str(world), str(folder / "store"), str(folder / f"rank{rank}.json")]
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_main() -> None:
    """A rank's body: join the gloo group, run the case, write its result (argv: case rank world store out)."""
    import importlib
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    case, rank, world, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        module, name = case.split(":")
        result = getattr(importlib.import_module(module), name)(init_device_mesh("cpu", (world,)))
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
