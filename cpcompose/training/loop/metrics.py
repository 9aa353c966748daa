"""What a run reports: a log line per step, TensorBoard scalars and a loss plot, from one rank."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cpcompose.training.loop.plot import plot_loss
from cpcompose.training.memory.resources import peak_resident_bytes

__all__ = ["MetricsLogger", "StepMetrics", "peak_memory_mib", "stamp"]


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the CPU resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_resident_bytes() / 2**20


@dataclass
class StepMetrics:
    """One optimizer step, as logged."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    peak_memory_mib: list[float]
    cp_bytes_sent: int
    cp_strategies: dict[str, int] = field(default_factory=dict)  # calls per strategy `auto` chose this step
    cp_predicted_s: float = 0.0  # the cost model's prediction for those calls
    router_loss: float | None = None  # a MoE model's router loss (its coefficient times it is in `loss`); None: none


def stamp() -> str:
    """The time prefix of every log line, so a slow step or a stall shows in the log itself."""
    return datetime.now().strftime("%H:%M:%S")


@dataclass
class MetricsLogger:
    """Prints progress and writes TensorBoard events and a loss PNG; inert on ranks other than 0.

    `history` holds the (step, loss) pairs of earlier invocations of the same run (from
    the checkpoint), so the plot covers the whole run across resumes. The TensorBoard
    writer is created at the first logged step: a run with nothing to train leaves no
    empty event file.
    """

    enabled: bool
    total_steps: int
    log_freq: int = 1
    tb_folder: Path | None = None
    plot_path: Path | None = None
    history: list[tuple[int, float]] = field(default_factory=list)
    _writer: Any = None
    _losses: list[tuple[int, float]] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter)

    def note(self, message: str) -> None:
        """A timestamped line from rank 0 (checkpoint saved, stopped by a signal, ...)."""
        if self.enabled:
            print(f"{stamp()} {message}", flush=True)

    def log(self, m: StepMetrics, *, first_step: int) -> None:
        """Record step `m`: TensorBoard every step, a printed line every `log_freq` steps."""
        if not self.enabled:
            return
        if self._writer is None and self.tb_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tb_folder))
        self._losses.append((m.step, m.loss))
        if m.step % self.log_freq == 0 or m.step in (first_step, self.total_steps):
            elapsed = time.perf_counter() - self._start
            eta = elapsed / (m.step - first_step + 1) * (self.total_steps - m.step)
            print(
                f"{stamp()} step {m.step:>5}/{self.total_steps}  loss {m.loss:.4f}  "
                + ("" if m.router_loss is None else f"router_loss {m.router_loss:.4f}  ") + f"lr {m.lr:.2e}  "
                f"grad_norm {m.grad_norm:.3f}  {m.tokens_per_s:,.0f} tok/s  {m.step_time_s:.2f} s/step  "
                f"peak {max(m.peak_memory_mib):,.0f} MiB  cp {m.cp_bytes_sent / 2**20:.1f} MiB  eta {eta:,.0f} s",
                flush=True,
            )
        if self._writer is not None:
            w = self._writer
            for name, value in (
                ("loss", m.loss), ("lr", m.lr), ("grad_norm", m.grad_norm), ("tokens_per_s", m.tokens_per_s),
                ("step_time_s", m.step_time_s), ("cp_bytes_sent", float(m.cp_bytes_sent)),
            ):
                w.add_scalar(f"train/{name}", value, m.step)
            if m.router_loss is not None:
                w.add_scalar("train/router_loss", m.router_loss, m.step)
            for rank, mib in enumerate(m.peak_memory_mib):
                w.add_scalar(f"memory/peak_mib_rank{rank}", mib, m.step)
            for label, calls in m.cp_strategies.items():  # strategy="auto": what it chose, per attention call
                w.add_scalar(f"cp/auto_calls/{label}", calls, m.step)
            if m.cp_strategies:
                w.add_scalar("cp/auto_predicted_s", m.cp_predicted_s, m.step)

    def close(self, title: str, checkpoint: Path | None = None) -> None:
        """Flush TensorBoard, draw the plot over the whole run, and name every output in one line."""
        if not self.enabled:
            return
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        run = [(s, x) for s, x in self.history if not self._losses or s < self._losses[0][0]] + self._losses
        outputs = []
        if self.plot_path is not None and run:
            steps, losses = zip(*run)
            plot_loss(steps, losses, self.plot_path, title=title)
            outputs.append(f"plot {self.plot_path}")
        if checkpoint is not None:
            outputs.append(f"checkpoint {checkpoint}")
        if self.tb_folder is not None and self._losses:
            outputs.append(f"tensorboard {self.tb_folder}")
        if self._losses:
            first, last = self._losses[0][1], self._losses[-1][1]
            print(
                f"{stamp()} done: {len(self._losses)} steps in {time.perf_counter() - self._start:,.1f} s, "
                f"loss {first:.4f} -> {last:.4f}" + "".join(f", {o}" for o in outputs),
                file=sys.stdout, flush=True,
            )
