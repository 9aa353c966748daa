"""Rank cases of `training.compile` on Hugging Face models: compiled decoder layers under a CP region.

`compiled_steps`: the trainer's compile (`apply_hf_compile`: each decoder layer whole, or with activation
checkpointing each layer's parts) on a float64 `hf_cases` model, two steps each in a new `context_parallel`
region, the second with recompiles made errors; beside it the same model eager under CP, and every graph
dynamo produced. `family_sweep`: every family the trainer trains, compiled (fullgraph) and run forward and
backward in a CP region, beside `compile_refusal`'s verdict on it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
import transformers as hf

from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy
from cpcompose.distributed import apply_activation_checkpointing
from cpcompose.parallel import recompute_context
from cpcompose.training.families.hf.compile import apply_hf_compile, compile_refusal
from tests.support import hf_cases as cases

OP = "torch.ops.cpcompose.attention"


def _recording(backend: str, graphs: list[str]) -> Any:
    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return recording


def _cp_step(mesh, model: torch.nn.Module, name: str, positions: torch.Tensor | None = None) -> dict:
    """One forward and backward of the plain batch in a new region (ring); loss summed, gradients all-reduced.
    `positions`: this rank's own (local, not a buffer) position ids instead of the region's."""
    model.zero_grad(set_to_none=True)
    ids, targets = cases.plain_batch(name)
    full = torch.arange(cases.SEQ)[None].clone()
    with context_parallel(mesh, buffers=[ids, targets, full], buffer_seq_dims=[1, 1, 1], strategy="ring",
                          verify=False):
        logits = cases.forward(model, name, input_ids=ids, position_ids=full if positions is None else positions)
        loss = cp_cross_entropy(logits, targets, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return cases.result(model, total)


def compiled_steps(mesh, name: str, state: dict, checkpointed: bool, backend: str = "aot_eager") -> dict:
    """Eager under CP, then two compiled steps (the second may not recompile), and the graphs."""
    torch._dynamo.reset()
    model = cases.build(name, "cpcompose", state)
    layers = list(model.model.layers)
    if checkpointed:
        apply_activation_checkpointing(layers, context_fn=recompute_context)
    model.train()
    eager = _cp_step(mesh, model, name)
    graphs: list[str] = []
    apply_hf_compile(layers, checkpointed=checkpointed, backend=_recording(backend, graphs))
    steps = [_cp_step(mesh, model, name)]
    with torch._dynamo.config.patch(error_on_recompile=True):  # a new region, the same graphs
        steps.append(_cp_step(mesh, model, name))
    return {"eager": eager, "steps": steps, "graphs": graphs}


def compiled_bad_positions(mesh, state: dict) -> dict:
    """Rank 1 alone passes its positions numbered from 0 (not a buffer): every rank raises from inside the op,
    naming them; then a valid compiled step in the same group."""
    torch._dynamo.reset()
    model = cases.build("llama", "cpcompose", state)
    apply_hf_compile(list(model.model.layers), checkpointed=False, backend="aot_eager")
    _cp_step(mesh, model, "llama")  # compiled with valid positions first: the bad call reuses its graphs
    rank = mesh.get_local_rank()
    local = torch.arange(cases.SEQ // mesh.size())[None] if rank == 1 else None
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            _cp_step(mesh, model, "llama", positions=local)
        error = "no error"
    except ValueError as e:
        error = str(e)
    return {"error": error, "after": _cp_step(mesh, model, "llama")}


def trained_families() -> dict[str, Any]:
    """Every family the trainer trains (the suite's lists: `hf_cases.ARCHS`, `HYBRIDS`, the DSA families, the MoE
    families), name -> a function making its tiny config: what the trainer builds, a causal LM
    (`AutoModelForCausalLM`; ModernBERT, a masked LM, and GLM-5-Next, multimodal, are not built by it)."""
    from tests.support.bf16_cases import DSA
    from tests.support.hf_trainer import MOE_FAMILIES, _moe_config
    from tests.support.hybrid_families import HYBRIDS

    made: dict[str, Any] = {name: make for name, make in cases.ARCHS.items() if name not in cases.MASKED_LM}
    made |= {name: hybrid.config for name, hybrid in HYBRIDS.items() if name != "glm5_next"}
    made |= {name: make for name, (make, _) in DSA.items()}
    common = dict(vocab_size=cases.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    made |= {f"moe_{name}": (lambda name=name: _moe_config(name, common)) for name in MOE_FAMILIES}
    # a family of the list with sliding-window layers (its ARCHS config has none)
    made["qwen3_window"] = lambda: hf.Qwen3Config(**dict(
        cases.ARCHS["qwen3"]().to_dict(), use_sliding_window=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]))
    return made


def family_sweep(mesh, names: list[str]) -> dict[str, dict]:
    """Each family compiled (dynamo, fullgraph) and run forward and backward in a CP region on `mesh`, float32: the
    error it raised (None: it ran) and what `compile_refusal` says of it before launch."""
    from tests.support.hybrid_families import HYBRIDS

    made, out = trained_families(), {}
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = made[name]()
        attention = HYBRIDS[name].attention if name in HYBRIDS else True
        model = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                    **({"attn_implementation": "cpcompose"} if attention else {}))
        refusal = compile_refusal(model, model.config)
        layers = getattr(getattr(model, model.base_model_prefix), "layers", None)
        layers = layers if layers is not None else getattr(model, model.base_model_prefix).blocks
        apply_hf_compile(list(layers), checkpointed=False, backend="eager")
        start = time.perf_counter()
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(2, min(vocab, cases.VOCAB), (1, cases.SEQ), generator=torch.Generator().manual_seed(1))
        targets, positions = torch.roll(ids, -1, 1), torch.arange(cases.SEQ)[None].clone()
        try:
            with context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1],
                                  strategy="ring", verify=False):
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
                cp_cross_entropy(logits, targets, mesh=mesh).backward()
            error = None
        except Exception as e:  # noqa: BLE001 (dynamo's Unsupported, the op's ValueError: any failure counts)
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        out[name] = {"error": error, "refusal": refusal, "seconds": time.perf_counter() - start}
    return out


def compiled_checkpoint_without_context(mesh, state: dict) -> str:
    """Compiled parts of checkpointed layers whose recomputation runs outside the region (torch's checkpoint
    without `recompute_context`): every rank refuses, as eagerly."""
    torch._dynamo.reset()
    model = cases.build("llama", "cpcompose", state)
    layers = list(model.model.layers)
    apply_activation_checkpointing(layers)
    apply_hf_compile(layers, checkpointed=True, backend="aot_eager")
    try:
        _cp_step(mesh, model, "llama")
    except Exception as e:  # noqa: BLE001 (raised while dynamo traces the recomputation: it may wrap the ValueError)
        return str(e)
    return "no error"
