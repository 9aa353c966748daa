"""The machine constants of the cost model (`Calibration`) and where ranks sit (`Topology`).

A `Calibration` is what `cost.calibrate` (`cpcompose-calibrate`) measures on the machine at
hand: the attention kernel's throughput by block size and its fixed cost per call,
the float32 merge and copy costs, and each link level's bandwidth and latency
(point-to-point, and how much of that the collectives reach). It is frozen and
hashable, and `fingerprint()` is a stable digest of its values, so ranks (and logs)
can check they chose a strategy from the same constants.

A `Topology` says which ranks share the fast links: the CP group's ranks are placed
in order, `ranks_per_node` to a node (torchrun's and Slurm's default placement).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = [
    "CPU_DEFAULT", "EXECUTORS", "H100_CLUSTER", "LEVELS", "Calibration", "Executor", "Link", "Topology",
    "default_calibration",
]

INTRA, INTER = "intra", "inter"  # link levels: inside a node, between nodes
LEVELS: tuple[str, ...] = (INTRA, INTER)
Executor = Literal["cuda_nccl", "cpu_gloo"]
EXECUTORS: tuple[str, ...] = get_args(Executor)


@dataclass(frozen=True)
class Link:
    """One link level: a message of n bytes takes `latency_s + n / bandwidth` (per direction).

    Attributes:
        bandwidth: bytes per second one rank can send on this level while receiving as much.
        latency_s: fixed cost of one exchange (posting, matching, first byte).
    """

    bandwidth: float
    latency_s: float

    def time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move `nbytes` in `messages` exchanges (no bytes: no time)."""
        return 0.0 if nbytes <= 0 and messages <= 0 else messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Calibration:
    """Machine constants, measured (`cpcompose-calibrate`) or published.

    Attributes:
        name: where they come from (printed in tables and logs).
        kernel_flops: `((block, FLOP/s), ...)`, increasing blocks: forward+backward
            attention throughput of one kernel call on a square block of that many
            queries and keys, FLOPs counted as flash-attn does (7 * pairs * (Dk + Dv) / 2
            per head for fwd+bwd: 2 * (Dk + Dv) per pair forward, 2.5x that backward).
            Interpolated linearly in log(block); clamped at the ends.
        kernel_call_s: fixed cost of one kernel call, forward and backward together
            (launch, Python, slicing): what makes many small blocks slow.
        merge_s_per_elem: float32 LSE merge, per output element (B * heads * rows * Dv)
            of each forward block; also the backward's float32 accumulation per element.
        copy_bandwidth: bytes/s of the reorders and concatenations around collectives.
        links: bandwidth and latency per level (`INTRA`, `INTER`).
        allgather_efficiency: fraction of the link bandwidth an all-gather or
            reduce-scatter reaches (ring algorithm: P-1 steps of one shard).
        alltoall_efficiency: the same for an all-to-all.
        overlap: fraction of a ring round's transfer hidden under its compute (1: a
            round takes max(compute, comm); 0: compute + comm).
        causal_tile: key tile of the kernel's causal skipping: a causal block computes its
            diagonal tiles whole, so n(n+1)/2 + n * min(tile, n) / 2 pairs (PyTorch's CPU
            flash kernel splits keys by 512; flash-attn 3 on H100 by ~128). It applies to
            each kernel call, so on "cpu_gloo" to each row tile of a tiled causal block.
        compute_slots_per_node: ranks of one node that compute at full speed at once
            (CPU cores here); None: every rank has its own device.
        executor: what runs the calls, where cpcompose runs them differently:
            "cpu_gloo": PyTorch's CPU flash kernel, on which every causal block of more
            than 256 rows runs as row tiles (`cpcompose.attention.local.cpu_tiles`), with gloo
            collectives (the gradients' reduce-scatter runs as an all-to-all and a
            local sum, `cpcompose.comm.start_reduce_scatter`); "cuda_nccl" (default):
            CUDA kernels, one call per block, and NCCL's ring reduce-scatter.
    """

    name: str
    kernel_flops: tuple[tuple[int, float], ...]
    kernel_call_s: float
    merge_s_per_elem: float
    copy_bandwidth: float
    links: tuple[tuple[str, Link], ...]
    allgather_efficiency: float = 1.0
    alltoall_efficiency: float = 1.0
    overlap: float = 1.0
    compute_slots_per_node: int | None = None
    causal_tile: int = 1
    executor: Executor = "cuda_nccl"

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        blocks = [b for b, _ in self.kernel_flops]
        if not blocks or blocks != sorted(set(blocks)) or any(f <= 0 for _, f in self.kernel_flops):
            raise ValueError("kernel_flops must be ((block, FLOP/s), ...) with increasing blocks and positive rates")
        if {name for name, _ in self.links} != set(LEVELS):
            raise ValueError(f"links must name each of {LEVELS}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def link(self, level: str) -> Link:
        return dict(self.links)[level]

    def throughput(self, block: float) -> float:
        """FLOP/s of a kernel call on a block of `block` rows (log-linear interpolation)."""
        blocks = [b for b, _ in self.kernel_flops]
        rates = [f for _, f in self.kernel_flops]
        if block <= blocks[0]:
            return rates[0]
        if block >= blocks[-1]:
            return rates[-1]
        i = bisect.bisect_right(blocks, block)
        t = (math.log(block) - math.log(blocks[i - 1])) / (math.log(blocks[i]) - math.log(blocks[i - 1]))
        return rates[i - 1] + t * (rates[i] - rates[i - 1])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kernel_flops"] = [list(p) for p in self.kernel_flops]
        d["links"] = {name: dataclasses.asdict(link) for name, link in self.links}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        d = dict(d)
        d["kernel_flops"] = tuple((int(b), float(f)) for b, f in d["kernel_flops"])
        d["links"] = tuple((name, Link(**d["links"][name])) for name in LEVELS)
        return cls(**d)

    def fingerprint(self) -> str:
        """A 16-hex-digit digest of every constant: equal in every process iff the constants are.

        Floats go through `repr` (shortest round-trip form), so it depends on values,
        not on the process (no salted `hash()`) or on JSON key order.
        """
        text = json.dumps(self.to_dict(), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Topology:
    """Where the CP group's ranks sit: rank r on node r // ranks_per_node.

    Attributes:
        ranks_per_node: CP ranks sharing one node's fast links (NVLink, or loopback
            here); None: all of them (one node).
    """

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive number of ranks, got {self.ranks_per_node}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Topology:
        """ranks_per_node from LOCAL_WORLD_SIZE (torchrun sets it) when set, else one node."""
        value = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE")
        return cls(int(value)) if value and value.isdigit() and int(value) > 0 else cls()

    def node(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def level(self, a: int, b: int) -> str:
        """The link level between ranks a and b."""
        return INTRA if self.node(a) == self.node(b) else INTER

    def on_node(self, world: int) -> int:
        """Ranks of the group on the busiest node."""
        return world if self.ranks_per_node is None else min(world, self.ranks_per_node)


# Published constants of an 8 x H100 SXM node cluster (see docs/strategy_choice.md for sources):
# flash-attention 3 bf16, head dim 128, fwd+bwd; NVLink 4 ~450 GB/s per direction per GPU
# (NCCL reaches ~80% of it); one 400 Gb/s InfiniBand NIC per GPU (50 GB/s, ~85% reached).
H100_CLUSTER = Calibration(
    name="8xH100-SXM nodes, NVLink 4 + 400G InfiniBand per GPU (published figures)",
    kernel_flops=((128, 60e12), (256, 130e12), (512, 250e12), (1024, 340e12), (2048, 400e12),
                  (4096, 440e12), (16384, 470e12)),
    kernel_call_s=2 * 8e-6,
    merge_s_per_elem=12 / 3.0e12,  # read out + lse, write out: ~12 B/elem at ~3 TB/s HBM
    copy_bandwidth=1.5e12,  # a copy reads and writes: half of HBM's ~3 TB/s
    links=((INTRA, Link(bandwidth=450e9 * 0.8, latency_s=10e-6)),
           (INTER, Link(bandwidth=50e9 * 0.85, latency_s=20e-6))),
    allgather_efficiency=1.0,
    alltoall_efficiency=0.9,
    overlap=1.0,
    compute_slots_per_node=None,
    causal_tile=128,
    executor="cuda_nccl",
)

# Defaults measured on this project's machine by `cpcompose-calibrate` (2-core AMD
# EPYC VM, torch 2.13 CPU, gloo loopback, one thread per rank; both link levels are loopback).
CPU_DEFAULT = Calibration(
    name="measured 2026-11-22 on the project's 2-core AMD EPYC VM, torch 2.13 CPU, gloo loopback, 1 thread/rank",
    kernel_flops=((128, 9.087e+10), (256, 8.45e+10), (512, 7.877e+10), (1024, 8.126e+10), (2048, 8.048e+10),
                  (4096, 7.911e+10)),
    kernel_call_s=0.0002019,
    merge_s_per_elem=5.045e-10,
    copy_bandwidth=1320000000.0,
    links=((INTRA, Link(bandwidth=1136000000.0, latency_s=0.0002375)),
           (INTER, Link(bandwidth=1136000000.0, latency_s=0.0002375))),
    allgather_efficiency=0.6535,
    alltoall_efficiency=1.0,
    overlap=1.0,
    compute_slots_per_node=2,
    causal_tile=512,
    executor="cpu_gloo",
)


def default_calibration(device_type: str) -> Calibration:
    """The shipped constants for a device type: `H100_CLUSTER` for "cuda", `CPU_DEFAULT` otherwise.

    A job on other hardware should calibrate (`cpcompose-calibrate`) and load its JSON.
    """
    return H100_CLUSTER if device_type == "cuda" else CPU_DEFAULT
