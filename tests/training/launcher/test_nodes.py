"""Several nodes: the mesh against the nodes before launch, and two torchrun "nodes" trained equal to one node.

The refusals and the warning go through the dry run (`WORLD_SIZE` and `LOCAL_WORLD_SIZE` set by hand, as
torchrun sets them on every node); preflight runs the same check before a real launch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cpcompose.train import main as train_main
from cpcompose.training.launcher.nodes import node_warnings, placement
from cpcompose.training.launcher.preflight import preflight
from cpcompose.config import ConfigError, load_config
from tests.support.trainer import TINY, run_trainer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("world, per_node, args, message", [
    (6, 3, ["--parallelism.tp=2", "--parallelism.dp_shard=-1", "--training.batch_size=6"],
     "parallelism.tp: 2 does not divide the 3 ranks of a node"),
    (8, 2, ["--parallelism.cp=4", "--parallelism.dp_shard=-1", "--parallelism.cp_strategy=alltoall_ring",
            "--parallelism.cp_alltoall_size=4"],
     "parallelism.cp_alltoall_size: blocks of 4 cp ranks = 4 ranks cross nodes of 2 ranks (torchrun "
     "--nproc-per-node), so the all-to-all that alltoall_ring keeps on a node's links crosses them; choose 2"),
    (4, 3, ["--parallelism.cp=2", "--parallelism.dp_shard=-1"],
     "torchrun --nproc-per-node: this node runs 3 ranks, which do not divide the world size 4"),
])
def test_a_mesh_that_does_not_fit_the_nodes_is_refused(monkeypatch, capsys, world: int, per_node: int,
                                                         args: list[str], message: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    assert train_main(TINY + args + ["--job.dry_run=true"]) == 2
    assert f"config error: {message}" in capsys.readouterr().err


def test_preflight_refuses_it_before_a_launch(monkeypatch, tmp_path: Path) -> None:
    """The same check in preflight, and a node with more ranks than GPUs (each rank takes GPU LOCAL_RANK)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    config = load_config(TINY + ["--parallelism.tp=2", "--parallelism.dp_shard=3", "--training.batch_size=6",
                                 f"--job.dump_folder={tmp_path}"])
    with pytest.raises(ConfigError, match="parallelism.tp: 2 does not divide the 3 ranks"):
        preflight(config, 6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = load_config(TINY + ["--training.device=cuda", "--parallelism.dp_shard=3", "--training.batch_size=6",
                               f"--job.dump_folder={tmp_path}"])
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node: 3 ranks on this node but 2 GPU"):
        preflight(cuda, 3)


def test_alltoall_across_nodes_is_warned(monkeypatch) -> None:
    """The banner's and the dry run's lines (the two-node run below shows them in a real banner)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = load_config(TINY + ["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall"])
    placed = placement(config, 4)
    assert placed.line() == ("nodes: 2 x 2 ranks; inside a node: cp 2 of 4 (2 ranks); "
                             "across nodes: cp 4 = 2 per node x 2 nodes")
    [warning] = node_warnings(config, placed)
    assert warning.startswith("warning: parallelism.cp_strategy = 'alltoall' over cp = 4 crosses nodes")
    assert "cp_strategy = 'alltoall_ring' with cp_alltoall_size = 2" in warning
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # cp = 3 on nodes of 4: groups straddle them unevenly
    uneven = load_config(TINY + ["--parallelism.cp=3", "--parallelism.dp_shard=4", "--training.seq_len=96"])
    warnings = node_warnings(uneven, placement(uneven, 12))
    assert [w.split(":")[1] for w in warnings] == [" parallelism.cp = 3", " parallelism.dp_shard = 4"]
    assert all("straddle the boundaries of nodes of 4 ranks unevenly" in w for w in warnings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_a_c10d_rendezvous_train_as_one_node(pools, tmp_path: Path) -> None:
    """Two torchrun agents of 2 ranks each meet at a c10d rendezvous on localhost (the multi-node launch, with
    two "nodes" on this machine) and train cp = 2 x dp_shard = 2 for 3 steps: the per-step loss equals one node
    of 4 ranks (a forked pool of the same trainer) to 1e-6 relative (the same ranks and mesh, only the threads
    per rank differ: float32 matmuls may then sum in another order, 6e-8 relative each). The banner says cp is
    inside a node and dp_shard across; one TensorBoard file and one checkpoint (4 shards, sealed once) are
    written for the whole job. 15 s on 2 quiet cores (43 s on busy ones): two agents, four ranks importing torch."""
    args = TINY + ["--training.steps=3", "--parallelism.cp=2", "--parallelism.dp_shard=2"]
    dump = tmp_path / "two_nodes"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT))
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"nodes-{port}",
             "-m", "cpcompose.train", *args, f"--job.dump_folder={dump}", "--checkpoint.enable=true",
             "--metrics.enable_tensorboard=true", "--comm.init_timeout_s=120"]
    start = time.perf_counter()
    agents = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
              for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    seconds = time.perf_counter() - start
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    out = "".join(o for o, _ in outputs)
    assert "nodes: 2 x 2 ranks; inside a node: cp 2 (2 ranks); across nodes: dp_shard 2" in out, out
    state = torch.load(dump / "checkpoint" / "step-3" / "trainer_state.pt", weights_only=False)
    two_nodes = [loss for _, loss in state["loss_history"]]
    one_node = pools.get(4).run(run_trainer, args + [f"--job.dump_folder={tmp_path / 'one_node'}"])[0]
    torch.testing.assert_close(torch.tensor(two_nodes), torch.tensor(one_node), rtol=1e-6, atol=0)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3"]
    assert len(list((dump / "checkpoint" / "step-3").glob("*.distcp"))) == 4
    assert len(list((dump / "tb").iterdir())) == 1, "one TensorBoard writer for the job (global rank 0)"
    print(f"two nodes of two ranks: {seconds:.1f} s")


def test_what_a_nodes_ranks_offload_must_fit_its_host_memory(monkeypatch) -> None:
    """On CUDA, activation offload keeps each rank's checkpointed activations in host memory: the ranks of a node
    (LOCAL_WORLD_SIZE) share its RAM, so the plan's host bytes times the ranks of a node are checked against it."""
    from cpcompose.training.memory import budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = load_config(TINY + ["--training.device=cuda", "--training.memory_budget_gib=80", "--parallelism.cp=4",
                                 "--training.seq_len=4096", "--activation_checkpoint.mode=full",
                                 "--activation_checkpoint.offload=true"])
    host = budget.run_plan(config, 4).host_bytes
    assert host > 0
    assert f"{host / 2**30:.3f} GiB per rank, {2 * host / 2**30:.3f} GiB for the 2 ranks of a node" in "\n".join(
        budget.describe_memory(config, 4))
    monkeypatch.setattr(budget, "host_memory", lambda: (int(1.5 * host), 0))
    with pytest.raises(ConfigError, match="activation_checkpoint.offload: the 2 ranks of this node would keep"):
        budget.check_memory(config, 4)
    monkeypatch.setattr(budget, "host_memory", lambda: (2 * host, 0))
    budget.check_memory(config, 4)


def test_the_slurm_script_starts_one_torchrun_agent_per_node(tmp_path: Path) -> None:
    """scripts/multinode_train.slurm, run by bash with `scontrol` and `srun` stubbed (no cluster here): the command
    it hands srun is torchrun's multi-node launch, as torchrun's own parser reads it."""
    from torch.distributed.run import get_args_parser

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'srun_args'}\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4321",
           "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_SUBMIT_DIR": str(tmp_path), "GPUS_PER_NODE": "4"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "multinode_train.slurm"), "--config", "my.toml",
                           "--parallelism.cp=8"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    srun = (tmp_path / "srun_args").read_text().splitlines()
    assert srun[:4] == ["--kill-on-bad-exit=1", "python", "-m", "cpcompose.training.launcher.torchrun"]
    args = get_args_parser().parse_args(srun[4:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "2", "4", "c10d", "gpu-node-07:29821", "4321")
    assert args.module and args.training_script == "cpcompose.train"
    assert args.training_script_args == ["--config", "my.toml", "--parallelism.cp=8"]


def test_auto_counts_the_cp_ranks_of_a_node(monkeypatch) -> None:
    """`cp_strategy = "auto"` prices each link by whether its CP ranks share a node: a node of LOCAL_WORLD_SIZE
    ranks holds LOCAL_WORLD_SIZE / tp of them (tp is innermost in the mesh)."""
    from cpcompose.attention.cost.calibration import Topology
    from cpcompose.config import cp_options

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = load_config(TINY + ["--parallelism.tp=2", "--parallelism.cp=8", "--parallelism.cp_strategy=auto"])
    assert cp_options(config.parallelism).topology == Topology(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cp_options(config.parallelism).topology is None
