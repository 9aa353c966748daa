"""The tiny trainer run the training tests share, in-process on every rank of a pool.

`TINY`: a 2-layer Llama on the synthetic recall task, 10 steps on the CPU, small
enough for a few seconds a run. `run_trainer` is a pool case (every rank calls the
trainer in-process); `run` runs `train_or_error` on a pool, so an expected
`TrainingError` comes back as its message instead of tearing the pool down.
"""

from __future__ import annotations

from cpcompose.config import load_config
from cpcompose.training.errors import TrainingError
from cpcompose.training.loop.trainer import Trainer

TINY = [
    "--model.vocab_size=64", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=64", "--training.seq_len=64", "--training.batch_size=4", "--training.steps=10",
    "--training.device=cpu", "--data.num_symbols=48", "--data.num_pairs=4", "--data.num_queries=4",
    "--lr_scheduler.warmup_steps=2", "--optimizer.lr=3e-3", "--metrics.log_freq=100",
    "--parallelism.pp_microbatches=2",
]


def run_trainer(mesh, args: list[str]) -> list[float]:
    return Trainer(load_config(TINY + args)).run()


def train_or_error(mesh, args: list[str]) -> dict:
    """Losses, or the TrainingError's message; and whether this rank still holds a lock."""
    try:
        return {"losses": Trainer(load_config(TINY + args)).run(), "error": None}
    except TrainingError as e:
        return {"losses": None, "error": str(e)}


def run(pools, args: list[str], world: int = 2) -> dict:
    results = pools.get(world).run(train_or_error, args)
    assert all(r == results[0] for r in results), f"ranks disagree: {results}"
    return results[0]
