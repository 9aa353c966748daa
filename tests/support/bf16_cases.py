"""Every family the transformers integration supports, in bfloat16: one process and CP, each against float64.

The families are the suite's own tiny models (`hybrid_families.HYBRIDS`, `hf_cases.ARCHS`, and
the DSA configs of tests/support/dsa_cases.py), with every top-k choice
taken out (`_continuous`). A family's float64 model is the truth; its weights, loaded into the
same family built in bfloat16 (`from_config(dtype=bfloat16)`: what transformers keeps in float32
stays float32), run once on one process, which shows how far bfloat16 alone takes the family,
and once under CP through the integration. `errors` measures both against float64;
tests/integrations/test_transformers_bfloat16.py holds CP to what one process shows.

Cost: one pool run per group size does every family; in the first, each rank also computes the
references of a share of the families (`reference_share`), which the second's results are held to.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import context_parallel, cp_cross_entropy, cp_unshard
from tests.support import hf_cases, hybrid_cases
from tests.support.dsa_cases import CONFIGS, REFERENCE_IMPL
from tests.support.hybrid_families import HYBRIDS

BATCH, SEQ, VOCAB = 2, 48, 64  # SEQ: zigzag chunks of 12 at P = 2, so a run meets a chunked kernel's chunk (8)
DOCS = hybrid_cases.DOCS  # 72 tokens: documents shorter and longer than a conv's width and a chunk
BF16 = torch.bfloat16
INDEX_ALL = 1 << 10  # an indexer's top-k above any row here (the first-use probe's 16 tokens a rank included)

# What CP carries across a rank boundary must weigh more than bfloat16's rounding (5e-3 relative), or a
# dropped state or halo passes unseen. At transformers' initialization (weights at std 0.02, A in [1, 16],
# steps softplus(dt_bias) in [0.001, 0.1], a `D` skip), dropping every carried state moved the logits by
# less than that in 14 of the 23 families that carry one. With the weights below, it moves them by 1.7x
# (Zamba) to 65x (xLSTM) the one-process error in all 23 (the gradients by 2.0x to 77x), and a zeroed
# conv halo by 1.7x to 54x in all 24 families with a conv: the test fails on both.
INIT_STD = 0.15  # every family's weights (the families' default 0.02; Zamba's tiny config already 0.15) ...
OWN_INIT = {"falcon_mamba"}  # ... but these: its weightless RMS norms on B, C and dt amplify bfloat16's rounding
# in the backward at 0.15 (one process: gradients 10-58% off float64, against 1% at its own 0.02)
SLOW_DECAY = 0.05  # `A` of every SSM, delta-rule and KDA layer (`A_log = log A`): a memory of tens of tokens
STEP = 2.0  # their step, `softplus(dt_bias)`


def _dsa() -> dict[str, tuple[Any, str]]:
    """DeepSeek sparse attention families: name -> (tiny config, the reference's attention)."""
    return {name: (made, REFERENCE_IMPL.get(name, "sdpa")) for name, made in CONFIGS.items()
            if not name.endswith("_ties")}  # the ties variant tests topk's tie-breaking, which `_continuous` removes


DSA = _dsa()
FAMILIES = (*sorted(HYBRIDS), *hf_cases.ARCHS, *sorted(DSA))
PACKED = FAMILIES  # DSA packed rows too: each document's top-k is the document alone's (reference: each alone)


def _continuous(config: hf.PretrainedConfig) -> hf.PretrainedConfig:
    """`config` with every expert chosen and every earlier key indexed: no top-k choice is left to flip.

    A router's top-1 of two experts (or an indexer's top-k of keys) has score margins of 1e-4 to 1e-3
    relative here, below bfloat16's rounding (4e-3): any run, CP or one process on another CPU, may flip
    a choice, which moves that token's output by O(1) (measured: gpt-oss at P = 2, two tokens' logits off
    by 0.5 relative). Choosing all of them leaves the routing weights (continuous) and the kernels' dtypes.
    """
    for part in (config, getattr(config, "text_config", None)):
        if part is None:
            continue
        experts = next((getattr(part, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                        if getattr(part, a, None)), None)
        if experts and getattr(part, "num_experts_per_tok", None):
            part.num_experts_per_tok = experts
        if getattr(part, "index_topk", None):
            part.index_topk = INDEX_ALL
    return config


def config(name: str, *, cp: bool) -> hf.PretrainedConfig:
    """The family's tiny config, its weights at `INIT_STD`, continuous; xLSTM's one process without its chunkwise
    kernel.

    transformers' xLSTM ("inference" mode, its default) fails in bfloat16 on one process from
    `chunk_size` tokens on (its chunkwise kernel meets float32 states with bfloat16 keys); below
    that it runs its recurrent kernel (float32 states: the mode's policy), which one process uses
    here for every row. The CP run keeps the family's chunk size, so its runs take the chunkwise kernel.
    """
    made = HYBRIDS[name].config() if name in HYBRIDS else DSA[name][0]() if name in DSA else hf_cases.ARCHS[name]()
    for part in (made, getattr(made, "text_config", None)):
        if part is not None and getattr(part, "initializer_range", None) and name not in OWN_INIT:
            part.initializer_range = INIT_STD
    if made.model_type == "xlstm" and not cp:
        made.chunk_size = 1 + max(SEQ, sum(DOCS))
    return _continuous(made)


def build(name: str, dtype: torch.dtype, *, cp: bool, state: dict | None = None) -> torch.nn.Module:
    """`name`'s tiny model in `dtype`: "cpcompose" attention when `cp`, else the family's reference attention;
    `state`'s weights, or its own initialization with a long memory (`_long_memory`)."""
    if name in HYBRIDS:
        model = hybrid_cases.build(name, state, cp=cp, dtype=dtype, config=config(name, cp=cp))
        if state is None:
            _long_memory(model)
        return model
    torch.manual_seed(0)
    if name in DSA:
        impl = "cpcompose" if cp else DSA[name][1]
        model = hf.AutoModelForCausalLM.from_config(config(name, cp=cp), attn_implementation=impl, dtype=dtype,
                                                    experts_implementation="eager")
    else:
        cls = hf.AutoModelForMaskedLM if name in hf_cases.MASKED_LM else hf.AutoModelForCausalLM
        reference = hf_cases.reference_impl(name)  # Gemma 2's float64 softmax; transformers' eager in bfloat16
        impl = "cpcompose" if cp else ("eager" if reference == "eager64" and dtype != torch.float64 else reference)
        model = cls.from_config(config(name, cp=cp), attn_implementation=impl, dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model


@torch.no_grad()
def _long_memory(model: torch.nn.Module) -> None:
    """Every SSM, delta-rule and KDA layer of `model` with `A = SLOW_DECAY`, a step of `STEP` and no `D` skip."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.fill_(math.log(SLOW_DECAY))
        elif name.endswith(".D"):
            p.zero_()
        elif name.endswith(("dt_bias", "dt_proj.bias", "dt_proj_bias")):
            p.fill_(math.log(math.expm1(STEP)))  # softplus(bias) = STEP


def _masked(name: str) -> bool:
    return name in hf_cases.MASKED_LM


def plain_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, labels if _masked(name) else cphf.shift_labels(labels)


def flattened() -> dict[str, torch.Tensor]:
    """The documents packed into one row by transformers' flattening collator (restarting position_ids)."""
    g = torch.Generator().manual_seed(2)
    docs = [{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in DOCS]
    return hf.DataCollatorWithFlattening(return_tensors="pt")(docs)


def _logits(model: torch.nn.Module, name: str, **inputs: Any) -> torch.Tensor:
    """The model's logits in float32 at least (transformers' own loss upcasts them the same way)."""
    logits = model(**inputs, **({} if _masked(name) else {"use_cache": False})).logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def one_process(name: str, kind: str, dtype: torch.dtype, state: dict | None = None) -> tuple[dict, dict]:
    """transformers alone on the whole plain batch (`kind` "plain"), or on each document alone ("packed");
    its loss, logits (the real tokens, in order) and gradients in float64, and the weights it started from."""
    model = build(name, dtype, cp=False, state=state)
    state = state if state is not None else {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "plain":
        ids, targets = plain_batch(name)
        logits = _logits(model, name, input_ids=ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    else:  # the pack's own targets (the collator's; shifted within each document for a causal LM)
        features = flattened()
        targets = features["labels"][0] if _masked(name) else cphf.shift_labels(features["labels"])[0]
        bounds = torch.tensor([0, *DOCS]).cumsum(0).tolist()
        logits = torch.cat([_logits(model, name, input_ids=features["input_ids"][:, a:b])[0]
                            for a, b in zip(bounds, bounds[1:])])
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach().double(), "logits": logits.detach().double(), "grads": _grads(model)}, state


def reference_share(mesh) -> dict:
    """(name, kind) -> {"float64": its float64 run, "one_process": the bfloat16 run's `errors`} (`one_process`), for
    this rank's share of the families (the float64 runs cost as much as the CP runs: the ranks split them)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    cases = [(name, "plain") for name in FAMILIES] + [(name, "packed") for name in PACKED]
    share = {}
    for name, kind in cases[rank::world]:
        exact, state = one_process(name, kind, torch.float64)
        share[name, kind] = {"float64": exact, "one_process": errors(one_process(name, kind, BF16, state)[0], exact)}
    return share


def _cp_step(mesh, model: torch.nn.Module, name: str, kind: str, strategy: str, probe: bool) -> dict:
    """One step of `model` under CP on the plain batch's zigzag split or `pack_batch`'s split of the documents
    (`probe`: the first-use probe on, as by default)."""
    model.zero_grad(set_to_none=True)
    if kind == "plain":
        ids, targets = plain_batch(name)
        positions = torch.arange(SEQ)[None].clone()
        region, layout = dict(buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1]), None
    else:
        features = flattened()
        batch = cphf.pack_batch(features["input_ids"], mesh, position_ids=features["position_ids"],
                                labels=features["labels"], shift=not _masked(name))
        ids, targets, positions, layout = batch.input_ids, batch.labels, batch.position_ids, batch.layout
        region = dict(buffers=batch.buffers, buffer_seq_dims=batch.seq_dims, layout=layout)
    with context_parallel(mesh, strategy=strategy, verify=probe, **region):
        logits = _logits(model, name, input_ids=ids, position_ids=positions)
        loss = cp_cross_entropy(logits, targets, mesh=mesh)
        loss.backward()
        full = cp_unshard(logits.detach(), mesh, seq_dim=1, **({} if layout is None else {"layout": layout}))
    full = full if layout is None else full[0, : sum(DOCS)]  # the pack's real tokens (its padding at the end)
    grads, shares = _summed_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"loss": total.double(), "logits": full.double(), "grads": grads, "shares": shares}


def _summed_gradients(model: torch.nn.Module, mesh) -> tuple[dict[str, torch.Tensor], float]:
    """Every rank's bfloat16 gradients summed in float64, and `|| sum over ranks of |share| ||` (every parameter).

    In float64, not in `allreduce_gradients`' bfloat16: the sum over ranks is data parallelism's, in the dtype a
    user reduces in (FSDP's `reduce_dtype`); what is measured here is the CP kernels' shares.
    """
    params = list(model.named_parameters())
    local = [p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64) for _, p in params]
    flat = torch.cat([torch.cat([g.flatten() for g in local]), torch.cat([g.abs().flatten() for g in local]),
                      torch.tensor([float(p.grad is not None) for _, p in params], dtype=torch.float64)])
    dist.all_reduce(flat, group=mesh.get_group())
    count = sum(g.numel() for g in local)
    summed, present = flat[:count].split([g.numel() for g in local]), flat[2 * count:]
    grads = {n: g.view_as(p) for (n, p), g, there in zip(params, summed, present.tolist()) if there}
    return grads, flat[count: 2 * count].norm().item()


def errors(got: dict, exact: dict) -> dict[str, float]:
    """`got`'s errors against the float64 run: the loss's (absolute), the logits' largest (absolute), and the
    logits' and the gradients' relative Frobenius norms (every parameter's gradient together)."""
    assert set(got["grads"]) == set(exact["grads"]), "gradients of other parameters"

    def norm_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return (torch.stack([(x - y).norm() for x, y in zip(a, b)]).norm()
                / torch.stack([y.norm() for y in b]).norm()).item()

    names = sorted(exact["grads"])
    return {
        "loss": (got["loss"] - exact["loss"]).abs().item(),
        "logits_max": (got["logits"] - exact["logits"]).abs().max().item(),
        "logits": norm_error([got["logits"]], [exact["logits"]]),
        "grads": norm_error([got["grads"][n] for n in names], [exact["grads"][n] for n in names]),
        "grads_norm": torch.stack([exact["grads"][n].norm() for n in names]).norm().item(),
        "loss_value": exact["loss"].abs().item(),
    }


def bf16_runs(mesh, strategies: dict[str, str], probe: bool, references: bool) -> dict:
    """Every family in bfloat16 under CP, for each kind of batch in `strategies` (kind -> region strategy), the
    first-use probe on each model's first step if `probe`.

    Returns:
        `{"cp": (name, kind) -> its CP result (on rank 0; None on the others, whose results are the same: losses
        and gradients are summed over the ranks, logits gathered), "references": this rank's `reference_share`
        if `references`, else None}`.
    """
    share = reference_share(mesh) if references else None
    out = {}
    for name in FAMILIES:
        state = build(name, torch.float64, cp=False).state_dict()  # the weights the references started from
        model = build(name, BF16, cp=True, state=state)  # one model per family: its first-use probe runs once
        for kind, strategy in strategies.items():
            if kind == "packed" and name not in PACKED:
                continue
            out[name, kind] = _cp_step(mesh, model, name, kind, strategy, probe)
    return {"cp": out if mesh.get_local_rank() == 0 else None, "references": share}
