"""Shared fixtures (the multi-process rank pools) and the `gpu` marker's selection.

Tests marked `gpu` run the parity, packed, composition and trainer cases on CUDA.
Without a CUDA device they are *deselected* (reported as such, never skipped and
counted green); asking for them anyway (`-m gpu`, or selecting only gpu tests)
without one is a usage error, so a GPU run can never pass empty.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

# CPU pools fork from this process (CUDA pools are spawned: tests/support/rank_pool.py). An
# availability check made here (the trainer's preflight in a test, a library import) asks
# NVML instead of initializing CUDA (cuInit), so this process stays cheap to fork and never
# holds a CUDA context. torch reads it at each call; children inherit it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# Inductor's on-disk cache does not key its CPU kernels by ATEN_CPU_CAPABILITY: kernels built by a default run
# and reused under ATEN_CPU_CAPABILITY=avx2 gave loss = NaN (tests/parallel/test_compile.py, trainer with full
# activation checkpointing; a fresh cache passes). One cache folder per capability, inherited by the ranks.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.gpu import NO_CUDA, cuda_device_count
from tests.support.rank_pool import PoolCache

_CUDA_COUNT = pytest.StashKey[int]()


def _asks_for_gpu(markexpr: str) -> bool:
    """Whether a `-m` expression selects gpu tests positively (`gpu`, `gpu and ...`), not `not gpu`."""
    return re.search(r"(?<!not )\bgpu\b", markexpr) is not None


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` have filtered the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    count = cuda_device_count()
    config.stash[_CUDA_COUNT] = count
    if count:
        return
    if _asks_for_gpu(config.getoption("markexpr") or "") or len(gpu) == len(items):
        raise pytest.UsageError(
            f"{NO_CUDA}: {len(gpu)} gpu test(s) selected, but torch {torch.__version__} sees no CUDA device. "
            "Run them on a machine with a GPU and a CUDA build of torch (README: 'The suite on CUDA')."
        )
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    count = config.stash.get(_CUDA_COUNT, None)
    if count:
        backend = f"NCCL for P <= {count}, gloo with host staging above"
        terminalreporter.write_line(f"gpu tests ran on {count} CUDA device(s): {backend}")


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolCache]:
    """Forked worker pools, one per group size and device, shared by the whole session."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(scope="session", autouse=True)
def token_store_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The per-user cache folder of the whole session (XDG_CACHE_HOME): a temporary one, never the real
    ~/.cache. Token stores are on by default and, without data.store_dir, kept in that cache
    (cpcompose/data/store/cache.py); set before any rank pool forks, so every rank, spawned process and command
    the suite runs inherits it."""
    folder = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folder))
        yield folder
