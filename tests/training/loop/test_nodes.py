"""What the ranks of several nodes agree on when they meet: every node the same size, one shared dump folder.

Two "nodes" of one rank each on a real gloo group: each rank is told its node (`GROUP_RANK`) and its node's
size (`LOCAL_WORLD_SIZE`) as torchrun tells it, and each looks at the dump folder it was given, so a folder
that is not shared is two folders here. Every case raises the same line on every rank, and a valid call in
the same group follows the refusals.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from cpcompose.config import load_config
from cpcompose.training.errors import TrainingError
from cpcompose.training.loop.nodes import agree_on_nodes


def _attempt(per_node: str, folder: Path) -> str | None:
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=per_node, GROUP_RANK=str(dist.get_rank()))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        agree_on_nodes(load_config([f"--job.dump_folder={folder}", "--checkpoint.enable=true"]))
        return None
    except TrainingError as e:
        assert e.exit_code == 2
        return str(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _cases(mesh, root: str) -> list[str | None]:
    rank, shared = dist.get_rank(), Path(root) / "shared"
    return [
        _attempt("1", Path(root) / f"disk-of-node-{rank}"),  # each node its own folder
        _attempt(str(1 + rank), shared),  # rank 1 alone says its node runs 2 ranks
        _attempt("1", shared),  # valid
    ]


def test_nodes_agree_on_their_size_and_one_dump_folder(pools, tmp_path: Path) -> None:
    results = pools.get(2).run(_cases, str(tmp_path))
    assert results[0] == results[1], "every rank raises the same line"
    not_shared, sizes, valid = results[0]
    assert not_shared.startswith(f"job.dump_folder: {tmp_path}/disk-of-node-0 is not one folder for the whole job: "
                                 "node(s) 1 (") and "a filesystem every node mounts" in not_shared
    assert sizes.startswith("torchrun --nproc-per-node: the nodes run different numbers of ranks")
    assert valid is None
    assert not list((tmp_path / "shared").iterdir()), "rank 0's marker is removed"
