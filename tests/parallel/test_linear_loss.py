"""`cp_linear_cross_entropy`: the unfused loss's value and gradients, with at most a chunk of logits alive.

Reference: `F.cross_entropy(F.linear(hidden, weight, bias))` (softcapped as Gemma does where asked) on one
process. Tolerances, and why:

* float64: relative to each tensor's largest entry, the derived bound (tests/support/tolerance.py) over the
  longest sum, tokens x vocab, on the loss and on every gradient (hidden, weight, bias). Both sides do the same
  arithmetic; only the order of the sums differs (per chunk, then over chunks; over ranks): measured <= 6e-14
  absolute on a token *sum* of ~200 and <= 2e-15 on gradients, while a wrong softmax, a missed ignore_index,
  a lost chunk or a mean of per-rank means is off by >= 1e-3.
* bf16 inputs: the fused loss keeps the log-sum-exp, the softmax gradient and the weight gradient's sum over
  chunks in float32; the unfused bf16 path rounds its gradient into bf16 before the weight matmul. So the
  fused error against float64 may not exceed the unfused bf16 error (x1.5 slack, plus one bf16 ulp of the
  tensor's scale: the two paths round different intermediates), on the loss and on each gradient.
* Memory: no tensor saved for backward, and no tensor any op makes in forward or backward, has more than
  `chunk_tokens x vocab` elements; the unfused loss, run under the same probes, breaks that bound (the probe
  can fail). Counted with `saved_tensors_hooks` and a `TorchDispatchMode` over every op's outputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cpcompose import cp_cross_entropy, cp_linear_cross_entropy
from cpcompose.parallel.chunked_loss import linear_cross_entropy_sum
from tests.support.live_storages import LargestMade, LiveWide
from tests.support.tolerance import relative_bound, relative_error

IGNORE = -100
N, DIM, VOCAB = 48, 8, 256
TOL = relative_bound(terms=N * VOCAB)  # derived, float64: the longest sum is over tokens x vocabulary


def _data(dtype: torch.dtype = torch.float64, *, seed: int = 0, batch: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (batch, N), generator=g)
    labels[:, ::5] = IGNORE
    labels[:, N // 2 + 3: N // 2 + 15] = IGNORE  # the second half has fewer valid tokens: uneven per rank
    return {
        "hidden": torch.randn(batch, N, DIM, generator=g, dtype=torch.float64).to(dtype),
        "weight": (torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64) * 0.7).to(dtype),
        "bias": torch.randn(VOCAB, generator=g, dtype=torch.float64).to(dtype),
        "labels": labels,
    }


def _flat(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`(batch, seq)` tokens as one row of tokens; the weight and bias as they are."""
    return {k: v.flatten(0, 1) if k in ("hidden", "labels") else v for k, v in data.items()}


def _unfused_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    softcap: float | None) -> torch.Tensor:
    """The unfused head: nn.Linear's arithmetic, then softcapping in float32 or wider."""
    z = F.linear(hidden, weight, bias).to(torch.promote_types(hidden.dtype, torch.float32))
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _run(fn: Any, data: dict[str, torch.Tensor], *, with_bias: bool) -> dict[str, torch.Tensor]:
    """Loss and the gradients of hidden, weight (and bias) of `fn(hidden, weight, bias, labels)`."""
    leaves = {k: data[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    loss = fn(leaves["hidden"], leaves["weight"], leaves["bias"] if with_bias else None, data["labels"])
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({k: v.grad for k, v in leaves.items() if v.grad is not None})
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {k: relative_error(got[k], want[k]) for k in want}


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, N, 1000])  # single tokens, a ragged last chunk, one chunk, more than all
def test_float64_equals_the_unfused_loss(softcap: float | None, with_bias: bool, chunk: int) -> None:
    data = _data()
    flat = _flat(data)
    want = _run(lambda h, w, b, y: F.cross_entropy(_unfused_logits(h, w, b, softcap), y, ignore_index=IGNORE,
                                                   reduction="sum"), flat, with_bias=with_bias)
    got = _run(lambda h, w, b, y: linear_cross_entropy_sum(h, w, y, bias=b, softcap=softcap, chunk_tokens=chunk),
               flat, with_bias=with_bias)
    worst = _worst(got, want)
    assert max(worst.values()) <= TOL, worst


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_bf16_is_at_least_as_accurate_as_the_unfused_bf16_loss(softcap: float | None) -> None:
    flat16 = _flat(_data(torch.bfloat16))

    def unfused(h, w, b, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(_unfused_logits(h, w, b, softcap), y, ignore_index=IGNORE, reduction="sum")

    def fused(h, w, b, y):  # type: ignore[no-untyped-def]
        return linear_cross_entropy_sum(h, w, y, bias=b, softcap=softcap, chunk_tokens=7)

    truth = _run(unfused, {k: v.double() if v.is_floating_point() else v for k, v in flat16.items()},
                 with_bias=True)  # the bf16 inputs, computed exactly
    got, base = _run(fused, flat16, with_bias=True), _run(unfused, flat16, with_bias=True)
    assert got["loss"].dtype == torch.float32 and got["hidden"].dtype == torch.bfloat16
    err, base_err = _worst(got, truth), _worst(base, truth)
    for k in err:
        ulp = 2.0**-8  # one bf16 rounding of the tensor's scale (errors are relative to it)
        assert err[k] <= 1.5 * base_err[k] + ulp, (k, err[k], base_err[k])


def _memory_probe(fn: Any, data: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(largest saved tensor, largest op output) over forward and backward of `fn`."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    made = LargestMade()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), made:
        _run(fn, data, with_bias=True)
    return max(saved, default=0), made.largest  # the fused loss saves nothing: its gradients are made in forward


def test_no_tensor_holds_more_than_a_chunk_of_logits() -> None:
    chunk = 8
    flat = _flat(_data(batch=2))
    bound = chunk * VOCAB
    assert DIM <= chunk and 2 * N * DIM <= bound  # so hidden and weight (and their grads) fit the bound too
    fused = _memory_probe(lambda h, w, b, y: linear_cross_entropy_sum(h, w, y, bias=b, softcap=2.5,
                                                                      chunk_tokens=chunk), flat)
    assert max(fused) <= bound, fused
    unfused = _memory_probe(lambda h, w, b, y: F.cross_entropy(_unfused_logits(h, w, b, 2.5), y,
                                                               ignore_index=IGNORE, reduction="sum"), flat)
    assert min(unfused) >= 2 * N * VOCAB > bound, unfused  # the probes see the whole logits when they exist


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_one_chunk_of_logits_is_alive_at_a_time(dtype: torch.dtype, softcap: float | None) -> None:
    """What the memory plan counts per chunk token: the float32 logits (the log-sum-exp and the softmax gradient
    are made in place in them), the tanh with softcapping (backward needs it), and under bf16 the chunk's bf16
    matmul output while it is cast (forward), or the bf16 gradient (backward). A chunk's tensors must be gone
    before the next chunk's are made (the probe caught two chunks alive at once, and a log-sum-exp temporary)."""
    chunk = 8
    flat = _flat(_data(dtype, batch=2))
    hidden, weight, bias = (flat[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    # the bf16 output or gradient never coexists with the tanh: 4 + 4 with softcapping at any dtype
    expected = chunk * VOCAB * (4 + (4 if softcap else 2 if dtype == torch.bfloat16 else 0))
    with LiveWide(VOCAB, exclude=[hidden, weight, bias]) as probe:
        linear_cross_entropy_sum(hidden, weight, flat["labels"], bias=bias, softcap=softcap,
                                 chunk_tokens=chunk).backward()
    assert weight.grad is not None and hidden.grad is not None
    assert probe.peak == expected  # exactly: the plan counts these bytes (`MemoryProfile.fused_loss_chunk`)


# ---------------------------------------------------------------- on real gloo groups


def _rank_loss(mesh, case: dict[str, Any]) -> dict[str, Any]:
    """This rank's half of the sequence: the fused and the unfused share, their gradients, the memory probe."""
    rank, world = mesh.get_local_rank(), mesh.size()
    data = _data(case["dtype"], batch=2)
    local = {k: v.chunk(world, dim=1)[rank] if k in ("hidden", "labels") else v for k, v in data.items()}
    softcap, chunk = case["softcap"], case["chunk"]

    def fused(h, w, b, y):  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["autocast"]):
            return cp_linear_cross_entropy(h, w, y, mesh=mesh, ignore_index=IGNORE, softcap=softcap, bias=b,
                                           chunk_tokens=chunk)

    def unfused(h, w, b, y):  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["autocast"]):
            logits = F.linear(h, w, b)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits = logits if softcap is None else softcap * torch.tanh(logits / softcap)
        return cp_cross_entropy(logits, y, mesh=mesh, ignore_index=IGNORE)

    out = {}
    for name, fn in (("fused", fused), ("unfused", unfused)):
        got = _run(fn, local, with_bias=True)
        for k in ("loss", "weight", "bias"):  # shares of the global mean: their sum over ranks is the total
            torch.distributed.all_reduce(got[k], group=mesh.get_group())
        out[name] = got
    out["probe"] = _memory_probe(fused, local)
    out["valid"] = int((local["labels"] != IGNORE).sum())
    return out


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_two_ranks_give_the_single_process_mean_float64(pools, softcap: float | None) -> None:
    case = {"dtype": torch.float64, "softcap": softcap, "chunk": 8, "autocast": False}
    per_rank = pools.get(2).run(_rank_loss, case)
    assert per_rank[0]["valid"] != per_rank[1]["valid"]  # uneven counts: a mean of means would be wrong
    data = _data(batch=2)
    want = _run(lambda h, w, b, y: F.cross_entropy(_unfused_logits(h, w, b, softcap).flatten(0, 1), y.flatten(),
                                                   ignore_index=IGNORE), data, with_bias=True)
    for rank, got in enumerate(per_rank):
        for name in ("fused", "unfused"):
            whole = dict(got[name], hidden=torch.cat([r[name]["hidden"] for r in per_rank], dim=1))
            worst = _worst(whole, want)
            assert max(worst.values()) <= TOL, (rank, name, worst)
        assert max(got["probe"]) <= 8 * VOCAB, got["probe"]


def test_two_ranks_under_bf16_autocast_follow_the_unfused_loss(pools) -> None:
    """float32 parameters under bf16 autocast, as the trainer runs them: the unfused path's numbers.

    Both run the head's matmul in bf16; the loss may differ only in float32 summation order (1e-6 relative
    allowed; measured identical), the hidden gradient likewise (measured identical), the weight and bias
    gradients by the unfused path's bf16 rounding of the logit gradient before its sum over tokens (measured
    2.7e-3 and 5.5e-3 of the largest entry; 2e-2 allowed).
    """
    case = {"dtype": torch.float32, "softcap": None, "chunk": 8, "autocast": True}
    for got in pools.get(2).run(_rank_loss, case):
        fused, unfused = got["fused"], got["unfused"]
        assert fused["hidden"].dtype == torch.float32 and fused["weight"].dtype == torch.float32
        torch.testing.assert_close(fused["loss"], unfused["loss"], rtol=1e-6, atol=0)
        for k in ("hidden", "weight", "bias"):
            torch.testing.assert_close(fused[k], unfused[k], rtol=0, atol=2e-2 * unfused[k].abs().max().item())


def _refusals(mesh) -> list[str]:
    data = _flat(_data())
    h, w, y = data["hidden"], data["weight"], data["labels"]
    calls = [
        lambda: cp_linear_cross_entropy(h, w, y[:-1], mesh=mesh),
        lambda: cp_linear_cross_entropy(h, w.T, y, mesh=mesh),
        lambda: cp_linear_cross_entropy(h, w, y, mesh=mesh, bias=data["bias"][:-1]),
        lambda: cp_linear_cross_entropy(h, w, y, mesh=mesh, chunk_tokens=0),
        lambda: cp_linear_cross_entropy(h, w, y, mesh=mesh, softcap=0.0),
        lambda: cp_linear_cross_entropy(h, w, y, mesh=mesh, num_tokens=1.0, kernel="liger"),
        lambda: cp_linear_cross_entropy(h, w, y, mesh=mesh, num_tokens=1.0, kernel="nope"),  # type: ignore[arg-type]
    ]
    messages = []
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    return messages


def test_bad_inputs_and_impossible_kernels_are_refused() -> None:
    messages = _refusals(None)  # every refusal comes before the token count's all-reduce: no group needed
    for needle in ("must agree on every dim", "must be (vocab, 8)", "one entry per vocabulary row",
                   "chunk_tokens must be >= 1", "softcap must be > 0", "runs on CUDA only", "must be one of auto"):
        assert any(needle in m for m in messages), (needle, messages)


# ---------------------------------------------------------------- on CUDA


def _cuda_case(mesh, kernel: str) -> dict[str, Any]:
    """float32 on the GPU by `kernel` and by the PyTorch path, and float64 on the host."""
    data = _flat(_data(batch=2))

    # One rank: the global token count is this rank's. The float64 truth lives on the host, which the pool's
    # one-rank NCCL group cannot all-reduce (torch: "No backend type associated with device type cpu"), so every
    # call is given the count instead of asking the group.
    count = float((data["labels"] != IGNORE).sum())

    def loss(kernel: str, device: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        moved = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in data.items()}
        return _run(lambda h, w, b, y: cp_linear_cross_entropy(h, w, y, mesh=mesh, ignore_index=IGNORE, bias=b,
                                                               softcap=2.5, chunk_tokens=8, kernel=kernel,
                                                               num_tokens=count),
                    moved, with_bias=True)

    return {"kernel": loss(kernel, "cuda", torch.float32), "torch": loss("torch", "cuda", torch.float32),
            "truth": loss("torch", "cpu", torch.float64)}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "liger", "cut_cross_entropy"])
def test_cuda_kernels_match_the_pytorch_path(pools, kernel: str) -> None:
    """Each installed CUDA kernel, and the PyTorch path on CUDA, within float32 rounding of float64.

    float32 against float64: 1e-5 relative to each tensor's largest entry (a loss of ~3 and gradients
    of ~1e-2 summed over 60 tokens and 40 classes: float32 rounding is ~1e-7 of that).
    """
    from cpcompose import _compat

    if kernel != "torch" and _compat.import_fused_linear_cross_entropy(kernel) is None:
        pytest.skip(f"{kernel} is not installed (pip install 'cpcompose[fused-loss]')")
    (got,) = pools.get(1, "cuda").run(_cuda_case, kernel)
    for name in ("kernel", "torch"):
        for k, truth in got["truth"].items():
            scale = truth.abs().max().item()
            torch.testing.assert_close(got[name][k].double(), truth, rtol=0, atol=1e-5 * scale, msg=f"{name} {k}")
