"""A transformers causal LM cut into pipeline stages at its decoder layers.

Module surgery only (no process groups): `split_causal_lm` turns a built `...ForCausalLM` into the stage
modules a rank runs, and the model itself into what the rank holds (its stages' parameters under the full
model's names). `torch.distributed.pipelining` runs the stages (`cpcompose.distributed.pipeline`).

Each stage runs the family's own base-model forward, so whatever it computes around the layers (rotary
tables, the causal mask, each layer type's mask, Qwen3-Next's linear-attention mask, ...) is computed as on
one process. During a stage's forward the base model's `layers` is a list as long as the model's, the stage's
own layers at their own places and a pass-through everywhere else: families that read
`config.layer_types[i]` by the loop's index, or slice `layers[:config.num_hidden_layers]`, see the index
they would on one process. On every stage but the first the incoming hidden states enter as
`inputs_embeds` (and the embedding's own factor, applied by some families' base forward to any
`inputs_embeds`, is set to one); on every stage but the last the final norm is an identity. The last
stage applies the output layer and what the family's forward does to the logits (`head.HEADS`).

What this cannot cut exactly is refused by name (`pipeline_refusal`): a family whose forward carries more
than the hidden states from layer to layer (hyper-connection streams, per-layer embeddings of the token ids,
GLM-5's shared indexers' top-k choice), parameters shared by layers of two stages (Zamba's shared
attention block), tied input and output embeddings (the first and the last stage would both hold them), a
family whose logits transform `head.HEADS` does not know. Every family of `head.HEADS` that is not refused is
checked against the whole model in float64, forward and every gradient, bitwise
(tests/integrations/test_transformers_pipeline.py, which also holds that no family of `HEADS` is left out).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.integrations.transformers.head import HEADS, causal_lm_head

__all__ = ["CUT_REFUSED", "CausalLMStage", "FINAL_NORMS", "held_layers_only", "pipeline_refusal", "split_causal_lm",
           "stage_layers", "stages_without_token_mixing"]

FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f", "ln_out", "out_norm")
"""The names families give the base model's last norm, which runs right before `lm_head`."""
_OWN_FINAL_NORMS = {"lfm2": "embedding_norm", "lfm2_moe": "embedding_norm", "lfm3": "embedding_norm"}
"""Families whose last norm has a name of its own (LFM2's runs after the layers despite its name)."""

CUT_REFUSED: dict[str, str] = {
    "zamba": "its hybrid layers share one attention block (and its inputs' concatenation with the embeddings)",
    "zamba2": "its hybrid layers share attention blocks and feed each the original embeddings beside the hidden "
              "states",
    "qwen4_exp_text": "its layers pass hyper-connection streams and per-layer n-gram embeddings of the token ids, not "
                 "one hidden state",
    "glm5_next": "its layers pass hyper-connection streams, not one hidden state",
    "glm_moe_dsa": "its layers pass their indexer's top-k choice to the next (shared indexers), not one hidden state",
}
"""`config.model_type` -> why its layers cannot be cut into pipeline stages (what they pass besides one hidden
state, or what the base forward does between them)."""

_EMBEDDING_FACTORS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # base forward: inputs_embeds * self.embedding_multiplier, whether or not it looked the ids up itself
    "granitemoehybrid": ("embedding_multiplier", lambda old: 1.0),
    "granite": ("embedding_multiplier", lambda old: 1.0),
    "granitemoe": ("embedding_multiplier", lambda old: 1.0),
    # base forward: hidden_states * self.normalizer (a bfloat16 buffer) on whatever embeds it was given
    "recurrent_gemma": ("normalizer", lambda old: torch.ones_like(old)),
}
"""`config.model_type` -> (the base model's attribute its forward multiplies any `inputs_embeds` by, its value
on a stage after the first: one, so the incoming hidden states pass unchanged)."""

_TUPLE_LAYERS = {"falcon_h1": 1, "bamba": 2, "xlstm": 2, "rwkv": 3}
"""Families whose layers return a tuple (Falcon-H1's loop reads `[0]`, Bamba's unpacks `(hidden, attention
weights)`, xLSTM's `(hidden, state)`, RWKV's `(hidden, state, attentions)`): `config.model_type` -> its length
(a pass-through fills it with the hidden states, then None)."""


_FLOAT32_LOGITS = frozenset({"mamba", "mamba2", "falcon_mamba", "nemotron_h", "xlstm"})
"""Families whose forward casts the logits to float32 (`lm_head(hidden).float()`, xLSTM's before its softcap): the
last stage does too."""


class _PassThrough(nn.Module):
    """A layer another stage runs: returns the hidden states it is given (a one-tuple where the family's loop
    indexes its layers' output). It carries the layer's plain attributes (`layer_type`, `block_type`,
    `layer_idx`, ...), which some base forwards read to choose a layer's mask."""

    def __init__(self, layer: nn.Module, as_tuple: int = 0) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and isinstance(value, (str, int, float, bool, type(None))):
                setattr(self, key, value)
        self.as_tuple = as_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *(None,) * (self.as_tuple - 1)) if self.as_tuple else hidden


def _base(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", None) or "", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(f"{type(model).__name__}: no base model at model.{model.base_model_prefix} to cut")
    return base


def _layers_name(base: nn.Module) -> str | None:
    for name in ("layers", "blocks"):
        if isinstance(getattr(base, name, None), nn.ModuleList) and len(getattr(base, name)):
            return name
    return None


def _final_norm_name(base: nn.Module) -> str | None:
    own = _OWN_FINAL_NORMS.get(getattr(getattr(base, "config", None), "model_type", None))
    if own is not None:
        return own
    return next((n for n in FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)), None)


def stage_layers(n_layers: int, num_stages: int, stage: int) -> range:
    """The layers of `stage` of `num_stages` (contiguous, even: `[s * n, (s + 1) * n)`)."""
    per = n_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def pipeline_refusal(model: nn.Module, num_stages: int) -> str | None:
    """Why `model` (a transformers causal LM, any device) cannot be cut into `num_stages` stages exactly, or None.

    The message names what to change (the model, the pp degree or the stages per rank)."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in CUT_REFUSED:
        return f"{name} ({model_type}) cannot be cut into pipeline stages: {CUT_REFUSED[model_type]}"
    if model_type not in HEADS:
        return (f"{name} ({model_type}): cpcompose does not know what its forward does to the logits after lm_head, "
                "which the last pipeline stage applies")
    try:
        base = _base(model)
    except ValueError as e:
        return str(e)
    layers_name = _layers_name(base)
    if layers_name is None:
        return f"{name}: no decoder layers at model.{model.base_model_prefix}.layers (or .blocks) to cut at"
    layers = getattr(base, layers_name)
    if num_stages > len(layers) or len(layers) % num_stages:
        return (f"{name} has {len(layers)} decoder layers, which do not split evenly into {num_stages} pipeline "
                "stages; choose parallelism.pp (and parallelism.pp_layers_per_stage) so that the stages divide them")
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or output is None:
        return f"{name}: no input or output embeddings to put on the first and the last stage"
    if any(p is q for p in embedding.parameters() for q in output.parameters()):
        return (f"{name} ties its input and output embeddings (tie_word_embeddings), which the first and the last "
                "pipeline stage would both hold; untie them (tie_word_embeddings = false in config.json, the output "
                "layer a copy of the embedding) or set parallelism.pp = 1")
    norm_name = _final_norm_name(base)
    placed = {id(p) for m in (embedding, output, layers, getattr(base, norm_name) if norm_name else None)
              if m is not None for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in placed]
    if outside:
        return (f"{name}: parameters outside its embedding, decoder layers, final norm and output layer "
                f"({', '.join(outside[:3])}), which no pipeline stage would hold; set parallelism.pp = 1")
    owner: dict[int, int] = {}
    for s in range(num_stages):
        for i in stage_layers(len(layers), num_stages, s):
            for p in layers[i].parameters():
                if owner.setdefault(id(p), s) != s:
                    return (f"{name}: decoder layers of pipeline stages {owner[id(p)]} and {s} share parameters, "
                            "which one stage alone must hold; set parallelism.pp = 1")
    return None


_FEED_FORWARD_TYPES = frozenset({"mlp", "moe"})
"""Layer types (Nemotron-H's `layers_block_type`) whose layers mix no tokens: a feed-forward block alone."""


def stages_without_token_mixing(model: nn.Module, num_stages: int) -> list[int]:
    """The stages of `num_stages` whose layers are all feed-forward blocks (by the config's per-layer types), in
    which no token mixes: a CP region around such a stage routes no attention and no mixer, which the region
    refuses as attention run on a shard alone."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or num_stages < 1 or len(types) % num_stages:
        return []
    return [s for s in range(num_stages)
            if all(types[i] in _FEED_FORWARD_TYPES for i in stage_layers(len(types), num_stages, s))]


class CausalLMStage(nn.Module):
    """One pipeline stage of a transformers causal LM: `stage(x, position_ids)`.

    `x` is token ids on the first stage and the hidden states `[mb, seq, hidden]` otherwise; the last stage
    returns the logits `[mb, seq, vocab]`, the others the hidden states. Its submodules are the model's own
    (`embed`, `layers` keyed by their index in the model, `norm`, `lm_head`, as the stage holds them), so FSDP
    can make the stage a root of its own while the model keeps every parameter under its full name.
    The trainer runs it inside its microbatch's CP region (`cpcompose.distributed.pipeline_stage.StageModule`).
    """

    def __init__(self, model: nn.Module, *, index: int, num_stages: int) -> None:
        super().__init__()
        base = _base(model)
        layers_name = _layers_name(base)
        assert layers_name is not None, "pipeline_refusal first"
        all_layers = getattr(base, layers_name)
        n = len(all_layers)
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        own = stage_layers(n, num_stages, index)
        self.layers = nn.ModuleDict({str(i): all_layers[i] for i in own})
        self.embed = model.get_input_embeddings() if self.first else None
        norm_name = _final_norm_name(base)
        self.norm = getattr(base, norm_name) if self.last and norm_name is not None else None
        self.lm_head = model.get_output_embeddings() if self.last else None
        model_type = model.config.model_type
        as_tuple = _TUPLE_LAYERS.get(model_type, 0)
        # Not submodules (so not in this stage's parameters): the model and the base whose forward runs.
        self.__dict__["_model"], self.__dict__["_base"] = model, base
        self.__dict__["_run_list"] = nn.ModuleList(
            [all_layers[i] if i in own else _PassThrough(all_layers[i], as_tuple) for i in range(n)])
        self._layers_name, self._norm_name = layers_name, norm_name
        self._factor = _EMBEDDING_FACTORS.get(model_type)
        self._float32_logits = model_type in _FLOAT32_LOGITS

    @contextlib.contextmanager
    def _as_stage(self) -> Iterator[None]:
        """The base model with this stage's layer list, an identity for the final norm before the last stage, and
        the embedding factor at one after the first; restored after."""
        base = self._base
        saved = dict(base._modules)
        factor = None
        try:
            base._modules[self._layers_name] = self._run_list
            if self._norm_name is not None and not self.last:
                base._modules[self._norm_name] = nn.Identity()
            if self._factor is not None and not self.first:
                attr, one = self._factor
                factor = getattr(base, attr)
                if isinstance(factor, Tensor):
                    base._buffers[attr] = one(factor)
                else:
                    base.__dict__[attr] = one(factor)
            yield
        finally:
            base._modules.clear()
            base._modules.update(saved)
            if factor is not None:
                attr = self._factor[0]
                if isinstance(factor, Tensor):
                    base._buffers[attr] = factor
                else:
                    base.__dict__[attr] = factor

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        inputs: dict[str, Any] = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        with self._as_stage():
            hidden = self._base(**inputs, use_cache=False).last_hidden_state
        if not self.last:
            return hidden
        head = causal_lm_head(self._model)
        logits = self.lm_head(hidden)  # the module (FSDP gathers it on its call), then what the family does
        if self._float32_logits:  # before the softcap, as the family's forward
            logits = logits.float()
        if head.scale is not None:
            logits = logits * head.scale
        return logits if head.softcap is None else head.softcap * torch.tanh(logits / head.softcap)


def split_causal_lm(model: nn.Module, *, num_stages: int, stages: Sequence[int]) -> tuple[CausalLMStage, ...]:
    """Cut `model` (on any device; the meta device avoids materialising what the rank drops) into the stage
    modules of `stages`, and drop from `model`, in place, every layer, embedding, norm and output layer none of
    them holds (the layers' places keep a parameterless pass-through, so the kept ones keep their full names).

    Raises:
        ValueError: `pipeline_refusal`'s reason, or a stage out of range.
    """
    refusal = pipeline_refusal(model, num_stages)
    if refusal is not None:
        raise ValueError(refusal)
    if not stages or any(not 0 <= s < num_stages for s in stages) or len(set(stages)) != len(stages):
        raise ValueError(f"stages must be distinct, in [0, {num_stages}): got {tuple(stages)}")
    made = tuple(CausalLMStage(model, index=s, num_stages=num_stages) for s in stages)
    base = _base(model)
    layers = getattr(base, _layers_name(base))  # type: ignore[arg-type]
    kept = {int(i) for stage in made for i in stage.layers}
    as_tuple = _TUPLE_LAYERS.get(model.config.model_type, 0)
    for i in range(len(layers)):
        if i not in kept:
            layers[i] = _PassThrough(layers[i], as_tuple)
    if 0 not in stages:
        model.set_input_embeddings(_Dropped())
    if num_stages - 1 not in stages:
        norm_name = _final_norm_name(base)
        if norm_name is not None:
            setattr(base, norm_name, nn.Identity())
        model.set_output_embeddings(_Dropped())
    return made


class _Dropped(nn.Module):
    """Where the model held a module another pipeline rank holds: no parameters, never called."""

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        raise RuntimeError("a module another pipeline rank holds was called on this rank")


@contextlib.contextmanager
def held_layers_only(model: nn.Module) -> Iterator[None]:
    """Within: the cut model's layer list holds its own layers alone, without the pass-throughs of the others'
    (for code that walks every layer's submodules, as Falcon-H1's `_init_weights` walks `layer.mamba`)."""
    base = _base(model)
    name = _layers_name(base)
    assert name is not None
    saved = base._modules[name]
    base._modules[name] = nn.ModuleList([layer for layer in saved if not isinstance(layer, _PassThrough)])
    try:
        yield
    finally:
        base._modules[name] = saved
