"""Checks made in the launching process, before any rank starts.

Every problem found here would otherwise surface after the ranks started, as one
long traceback per rank (or, for an unwritable folder, at the first save). Each
check raises a ConfigError whose one-line message names the key to change.
"""

from __future__ import annotations

import codecs
import tempfile
from pathlib import Path

import torch

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.loader import build_data_source, data_config_error
from cpcompose.data.tokenizer import build_tokenizer
from cpcompose.models import model_names
from cpcompose.training.memory_budget import check_memory
from cpcompose.training.checkpoint import CheckpointManager, earlier_run_message, saved_step, verify
from cpcompose.training.run_lock import LOCK_NAME, holder

__all__ = ["check_choices", "preflight"]

_SUFFIXES = (".txt", ".jsonl")


def check_choices(config: JobConfig) -> None:
    """What the config schema cannot know: whether `model.name` is a registered family and
    whether the data task's parameters fit (no I/O; the dry run runs this too).

    Raises:
        ConfigError: naming the key to change.
    """
    names = model_names()
    if config.model.name not in names:
        raise ConfigError(f"model.name: {config.model.name!r} is not one of {', '.join(names)}")
    if (error := data_config_error(config)) is not None:
        raise error


def preflight(config: JobConfig, world: int) -> str | None:
    """Check the choices (`check_choices`), device, data, vocabulary, the memory plan and the dump folder.

    Returns:
        A message when there is nothing to train (the checkpoint already reached
        `training.steps`), so the caller can stop without starting ranks; else None.
    Raises:
        ConfigError: naming the key to change.
    """
    check_choices(config)
    _check_device(config)
    _check_data(config, world)
    check_memory(config, world)
    return _check_dump_folder(config)


def _check_device(config: JobConfig) -> None:
    if config.training.device == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"training.device: 'cuda' requested but {why}; set --training.device=cpu (or auto)")


def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"data.path: no .txt or .jsonl files under {path}")
        return files
    if not path.is_file():
        raise ConfigError(f"data.path: {path} does not exist")
    return [path]


def _check_utf8(file: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with file.open("rb") as f:
        while chunk := f.read(1 << 22):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"data.path: {file} is not UTF-8 text (byte {offset + e.start}); cpcompose reads .txt/.jsonl "
                    "text files only"
                ) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ConfigError(f"data.path: {file} ends inside a UTF-8 character (truncated?)") from None


def _check_data(config: JobConfig, world: int) -> None:
    d = config.data
    if d.source == "synthetic":
        build_data_source(config, dp_rank=0, dp_size=1)  # cheap: checks the vocabulary covers the task
        return
    assert d.path is not None
    for file in _data_files(Path(d.path)):
        _check_utf8(file)
    if d.tokenizer is not None and not Path(d.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer: {d.tokenizer} does not exist")
    vocab = build_tokenizer(d.tokenizer, eos_token=d.eos_token).vocab_size
    if vocab > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {config.model.vocab_size} is smaller than the tokenizer's {vocab} ids; "
                          f"set --model.vocab_size={vocab} or more")


def _check_dump_folder(config: JobConfig) -> str | None:
    dump = Path(config.job.dump_folder)
    try:
        dump.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dump, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"job.dump_folder: cannot write to {dump} ({e.strerror}); choose another folder") from None
    if (info := holder(dump)) is not None:
        raise ConfigError(
            f"job.dump_folder: {dump} is in use by another job (pid {info.get('pid')} on {info.get('host')}); "
            f"choose another folder, or delete {dump / LOCK_NAME} if that job is gone"
        )
    c = config.checkpoint
    if not c.enable:
        return None
    manager = CheckpointManager(dump / c.folder, interval=c.interval, keep_latest_k=c.keep_latest_k)
    existing = manager.complete()
    if existing and not c.resume:
        raise ConfigError(f"checkpoint.resume: {earlier_run_message(manager.folder, existing)}")
    for _, path in reversed(existing):
        if verify(path) is None:
            step = saved_step(path)
            if step >= config.training.steps:
                return (f"nothing to train: {path} is already at step {step} of training.steps = "
                        f"{config.training.steps}; raise --training.steps, or start fresh in another "
                        "--job.dump_folder")
            return None
    return None
