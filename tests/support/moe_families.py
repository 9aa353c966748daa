"""Every mixture-of-experts causal LM in transformers' auto mapping, built tiny (the EP survey's test).

A family counts as MoE when its modeling file names `experts` (a text scan: cheap, no import). Its config is
transformers' default with the small sizes below for whatever keys it has (every layer sparse, 4 experts, 2 per
token), or a family's own tiny config where the generic one does not build. A family whose tiny build still
holds more than `MAX_PARAMETERS` (a multimodal wrapper's vision tower at its default size; its text model is in
the mapping under its own type) or cannot be built from these keys is listed, with why, in `NOT_BUILT`: the
test checks the list is exact, so a new transformers release that adds or fixes a family shows up. Models are
built on the meta device: the test materialises their experts modules alone.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import torch
import transformers as hf
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.support.hybrid_families import HYBRIDS

MAX_PARAMETERS = 20_000_000  # a tiny build above this is a default-size tower: never allocated (see above)
SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, shared_expert_intermediate_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], num_dense_layers=0, first_k_dense=0,
    moe_layer_freq=1, n_group=1, topk_group=1,
)
OWN_CONFIGS = {  # the families whose tiny config the generic keys do not give
    "granitemoehybrid": HYBRIDS["granitemoehybrid"].config,
    "lfm2_moe": HYBRIDS["lfm2_moe"].config,
    "qwen4_exp": HYBRIDS["qwen4_exp"].config,
    "dbrx": lambda: hf.DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=64,
                                  attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                                  ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}),
    "zaya": lambda: _generic("zaya", num_experts_per_tok=1),  # "supports num_experts_per_tok=1 only"
}
NOT_BUILT = {  # model type -> why the survey cannot build it tiny
    "deepseek_v32": "above MAX_PARAMETERS with the generic keys (its indexer's defaults)",
    "glm_moe_dsa": "above MAX_PARAMETERS with the generic keys (its indexer's defaults)",
    "dots3_note": "a multimodal wrapper (its text model: dots3_note_text)",
    "gemma4": "a multimodal wrapper (its text model: gemma4_text)",
    "llama4": "a multimodal wrapper (its text model: llama4_text)",
    "qwen3_5_moe": "a multimodal wrapper (its text model: qwen3_5_moe_text)",
    "dots1": "its config needs keys the generic ones do not set",
    "dots3_note_text": "per-layer attributes (num_attention_heads) the generic keys cannot set",
    "gemma4_text": "per-layer attributes (head_dim) the generic keys cannot set",
}
NO_EXPERTS = {  # model type -> why its tiny build holds no experts module (the trainer refuses ep > 1 by name)
    "beam": "its modeling file names experts, but its tiny build has none",
    "doge": "product-key experts (embeddings looked up per token), not an experts module",
}
FLOAT32_SUM = {"inkling2_text", "inkling2_loop_text"}
"""Eager loops that sum the k choices in float32 whatever the model's dtype ("as in the original"; their default
grouped_mm path sums in the model's dtype, as EP does): compared at float32's rounding."""


def _generic(model_type: str, **more: Any) -> hf.PretrainedConfig:
    cls = type(hf.AutoConfig.for_model(model_type))
    default = cls()
    return cls(**{k: v for k, v in {**SMALL, **more}.items() if hasattr(default, k)})


def moe_model_types() -> list[str]:
    """The causal-LM model types whose modeling file names `experts` (a type without a modeling file of its own,
    as Sarvam's, reuses another family's classes: the file defining its causal LM class is read)."""
    root = Path(hf.__file__).parent / "models"
    found = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        folder = model_type_to_module_name(model_type)
        path = root / folder / f"modeling_{folder}.py"
        if not path.exists():
            path = Path(inspect.getsourcefile(getattr(hf, class_name)) or "")
        if path.is_file() and re.search(r"\bexperts\b", path.read_text()):
            found.append(model_type)
    return found


def build_tiny(model_type: str) -> torch.nn.Module | str:
    """The family's tiny float64 causal LM (experts' eager loop) on the meta device (the test gives memory to its
    experts modules alone), or why it cannot be built (`NOT_BUILT`'s text is the test's; this returns the error)."""
    try:
        config = OWN_CONFIGS[model_type]() if model_type in OWN_CONFIGS else _generic(model_type)
        with torch.device("meta"):
            meta = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
        size = sum(p.numel() for p in meta.parameters())
        return f"{size} parameters" if size > MAX_PARAMETERS else meta
    except Exception as e:  # noqa: BLE001 - the survey records why, the test checks the list
        return f"{type(e).__name__}: {e}"
