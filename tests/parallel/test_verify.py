"""The exactness probe names the first module that computes something else under CP, on every rank.

A model that mixes tokens outside attention without being CP-aware (here a causal
depthwise convolution over the sequence, the short convolution of LFM2 and Mamba, and an
attention written as an explicit softmax) is silently wrong on a shard: `verify` must
name it on every rank; the same model with the convolution made CP-aware
(`cpcompose.mixers.cp_causal_conv1d`) and SDPA attention must pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpcompose import verify
from cpcompose.mixers import cp_causal_conv1d, cp_linear_scan
from cpcompose.parallel import active_cp_region

DIM, HEADS, SEQ = 16, 2, 32


class CausalConv(nn.Module):
    """A depthwise causal convolution over the sequence: the hidden token mixer."""

    def __init__(self, cp_aware: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 4, groups=DIM, padding=3)
        self.cp_aware = cp_aware

    def forward(self, x):
        region = active_cp_region()
        if self.cp_aware and region is not None:
            return cp_causal_conv1d(x, self.conv.weight, self.conv.bias, mesh=region.mesh, layout=region.options.layout)
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, explicit: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.explicit = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), explicit

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if self.explicit:  # eager attention: a softmax over this rank's keys only
            scores = (q @ k.transpose(-1, -2)) / (DIM // HEADS) ** 0.5
            scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
            o = scores.softmax(-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.norm, self.mixer, self.mlp = nn.LayerNorm(DIM), mixer, nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.mlp(self.mixer(self.norm(x)))


class Model(nn.Module):
    def __init__(self, conv: str, explicit: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, DIM)
        mixers = [Attention(explicit)] + ([CausalConv(conv == "aware")] if conv != "none" else []) + [Attention(False)]
        self.blocks = nn.ModuleList(Block(m) for m in mixers)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


def probe(mesh, conv: str, explicit: bool, strategy: str) -> str:
    torch.manual_seed(0)
    model = Model(conv, explicit).double()
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        verify(model, mesh, [tokens], strategy=strategy)
    except ValueError as e:
        return str(e)
    return "exact"


@pytest.mark.parametrize("world,strategy", [(2, "ring"), (4, "allgather")])
def test_the_probe_names_a_hidden_unrouted_mixer(pools, world: int, strategy: str) -> None:
    for message in pools.get(world).run(probe, "plain", False, strategy):
        assert "module 'blocks.1.mixer' (CausalConv)" in message, message  # its conv's padded output is no evidence
        assert "mixes tokens outside attention" in message


def test_the_probe_names_an_explicit_softmax_attention(pools) -> None:
    for message in pools.get(2).run(probe, "none", True, "ring"):
        assert "module 'blocks.0.mixer' (Attention)" in message, message


@pytest.mark.parametrize("world", [2, 4])
def test_the_probe_passes_what_is_exact(pools, world: int) -> None:
    assert pools.get(world).run(probe, "aware", False, "ring") == ["exact"] * world


# --- bfloat16: judged against what one bfloat16 process gives, not a fixed number ---


class MambaLike(nn.Module):
    """Mamba's mixer in miniature: a causal conv, then a selective linear recurrence h_t = a_t * h_{t-1} + u_t."""

    def __init__(self, conv: str) -> None:
        super().__init__()
        self.conv = CausalConv(conv == "aware")
        self.gate, self.step = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        x = F.silu(self.conv(x))
        a, u = torch.exp(-F.softplus(self.step(x))), x * torch.sigmoid(self.gate(x))
        region = active_cp_region()
        if region is not None:
            return cp_linear_scan(a, u, mesh=region.mesh, layout=region.options.layout)
        h, out = torch.zeros_like(u[:, 0]), []
        for t in range(u.shape[1]):
            h = a[:, t] * h + u[:, t]
            out.append(h)
        return torch.stack(out, 1)


class Hybrid(nn.Module):
    """Embedding, a Mamba-like block, an attention block, a Mamba-like block."""

    def __init__(self, conv: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, DIM)
        self.blocks = nn.ModuleList(Block(m) for m in (MambaLike(conv), Attention(False), MambaLike(conv)))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


def probe_low_precision(mesh, conv: str, dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    model = Hybrid(conv).to(dtype)
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        verify(model, mesh, [tokens], strategy="ring")
    except ValueError as e:
        return str(e)
    return "exact"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_hybrid_as_exact_as_one_process_passes(pools, dtype: torch.dtype) -> None:
    """Its CP outputs differ from the same dtype on one process by up to 8e-3 (bf16), 1.5e-3 (fp16): rounding,
    measured as within 2.2x of one process's own error against float64."""
    assert pools.get(2).run(probe_low_precision, "aware", dtype) == ["exact"] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_hybrid_with_a_local_conv_still_fails(pools, dtype: torch.dtype) -> None:
    for message in pools.get(2).run(probe_low_precision, "plain", dtype):
        assert "module 'blocks.0.mixer.conv' (CausalConv)" in message, message
        assert "against a float64 run" in message


# --- the Hugging Face integration probes a model on its first forward in a CP region ---


def hf_first_use(mesh, unroute: bool, verify_option: bool) -> dict:
    """An LFM2 model (short convolutions beside attention); `unroute`: its conv kernel left local, as a mixer
    cpcompose did not know would be."""
    from tests.support import hybrid_cases as cases
    from transformers.models.lfm2 import modeling_lfm2

    from cpcompose import context_parallel

    routed = modeling_lfm2.causal_conv1d_fn
    if unroute:
        modeling_lfm2.causal_conv1d_fn = routed.__wrapped__  # the original, which sees only this rank's shard
    try:
        model = cases.build("lfm2")
        ids, _ = cases.plain_batch()
        positions = torch.arange(cases.SEQ)[None].clone()
        messages = []
        for _ in range(2):  # the second forward must not probe again
            try:
                with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], verify=verify_option):
                    model(input_ids=ids, position_ids=positions, use_cache=False)
                messages.append("ran")
            except ValueError as e:
                messages.append(str(e))
        return {"messages": messages}
    finally:
        modeling_lfm2.causal_conv1d_fn = routed


def test_hf_first_use_names_an_unrouted_mixer_on_every_rank(pools) -> None:
    for got in pools.get(2).run(hf_first_use, True, True):
        first, second = got["messages"]
        assert "module 'model.layers.0.conv'" in first and "(Lfm2ShortConv)" in first, first
        assert second == "ran"  # probed once per model (then the user owns what runs)


def test_hf_first_use_probe_passes_a_routed_model_and_can_be_turned_off(pools) -> None:
    assert [g["messages"] for g in pools.get(2).run(hf_first_use, False, True)] == [["ran", "ran"]] * 2
    assert [g["messages"] for g in pools.get(2).run(hf_first_use, True, False)] == [["ran", "ran"]] * 2


# --- the trainer probes its model at start (parallelism.cp_verify) ---

TRAINER = [
    "--model.vocab_size=64", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=64", "--training.seq_len=64", "--training.batch_size=2", "--training.steps=1",
    "--training.device=cpu", "--parallelism.cp=2", "--lr_scheduler.warmup_steps=0", "--metrics.log_freq=100",
    "--data.num_symbols=48", "--data.num_pairs=4", "--data.num_queries=4",
]


def trainer_start(mesh, leak: bool, verify_option: bool, dump: str) -> str:
    """Build the trainer; `leak`: its feed-forward also adds a running sum over the sequence (a token mixer)."""
    from cpcompose.config import load_config
    from cpcompose.models.llama import model as llama
    from cpcompose.training.errors import TrainingError
    from cpcompose.training.loop.trainer import Trainer

    original = llama.FeedForward.forward
    if leak:
        llama.FeedForward.forward = lambda self, x: original(self, x) + 1e-3 * x.cumsum(dim=1)
    try:
        Trainer(load_config(TRAINER + [f"--parallelism.cp_verify={str(verify_option).lower()}",
                                       f"--job.dump_folder={dump}"]))
        return "built"
    except TrainingError as e:
        return f"{e.exit_code}: {e}"
    finally:
        llama.FeedForward.forward = original


def test_the_trainer_refuses_a_model_with_a_hidden_mixer_at_start(pools, tmp_path) -> None:
    for message in pools.get(2).run(trainer_start, True, True, str(tmp_path / "a")):
        assert message.startswith("2: parallelism.cp_verify: cpcompose.verify: module 'layers.0.feed_forward'"), message
    assert pools.get(2).run(trainer_start, False, True, str(tmp_path / "b")) == ["built"] * 2
    assert pools.get(2).run(trainer_start, True, False, str(tmp_path / "c")) == ["built"] * 2  # the probe is off
