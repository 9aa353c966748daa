"""The trainer on a token store: the ranks of a real gloo group open (one building, the others waiting at the
lock) the same store and best-fit packed sample index, and cp = 2 and dp = 2 follow cp = 1's loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.token_stores import random_lengths, write_documents
from tests.support.trainer import run_trainer

STORE = ["--data.source=text", "--data.pack=true", "--model.vocab_size=260", "--training.seq_len=64",
         "--training.steps=4"]


@pytest.mark.parametrize("name,args", [("cp2", ["--parallelism.cp=2"]), ("dp2", ["--parallelism.dp_shard=2"])])
def test_two_ranks_on_one_store_follow_one_rank(pools, tmp_path: Path, name: str, args: list[str]) -> None:
    """Same tolerance as the trainer's packed-text test (1e-5 relative): fp32 summed in another order."""
    corpus = write_documents(tmp_path / "d" / "docs.jsonl", random_lengths(80, 1, 150, seed=5))
    common = STORE + [f"--data.path={corpus}", f"--data.store_dir={tmp_path / 'stores'}"]
    one = pools.get(1, "cpu").run(run_trainer, common + [f"--job.dump_folder={tmp_path / 'one'}"])[0]
    fresh = common[:-1] + [f"--data.store_dir={tmp_path / name}"]  # built by the two ranks themselves
    got = pools.get(2, "cpu").run(run_trainer, fresh + args + [f"--job.dump_folder={tmp_path / 'two'}"])
    assert got[0] == got[1]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(one), rtol=1e-5, atol=0)
