"""The trainer's table of router losses (`cpcompose.training.families.hf.router_loss.LOAD_BALANCING`) against the
installed transformers: what it lists is what transformers computes, and no causal LM that computes it is missing.

Each listed `model_type`'s causal LM (the class `AutoModelForCausalLM` builds) has a forward that calls its module's
`load_balancing_loss_func`, whose body is Qwen3-MoE's (the one `tests/parallel/test_router_loss.py` checks
`cp_load_balancing_loss` against, so that check covers every entry), on `outputs.router_logits`, `self.num_experts`,
`self.num_experts_per_tok` and adds `self.router_aux_loss_coef` times it, those set in `__init__` from the config
keys the table lists; no listed module computes a router z-loss. Read from the modeling files' syntax trees (about a
second for 26 files; importing them takes three): no module imported, no model built.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cpcompose.config import ConfigError
from cpcompose.training.families.hf.router_loss import LOAD_BALANCING, router_loss_of
from cpcompose.training.families.record import RouterLoss

transformers = pytest.importorskip("transformers")

from transformers.models.auto.configuration_auto import model_type_to_module_name  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

NAME = "load_balancing_loss_func"
NOT_LISTED = {
    "doge": "another loss: product-key experts, its own load_balancing_loss_func",
    "jetmoe": "its own experts class in the MLP and in attention; the coefficient is aux_loss_coef",
    "deepseek_v4": "its attention is refused; hash routing by token id in some layers",
}
"""Causal LMs that call a `load_balancing_loss_func` but are left out of the table (refused by name), and why."""


def _source(model_type: str) -> str:
    module = model_type_to_module_name(model_type)
    return (Path(transformers.__file__).parent / "models" / module / f"modeling_{module}.py").read_text()


def _defs(body: list[ast.stmt]) -> dict[str, ast.AST]:
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _body(function: ast.FunctionDef) -> str:
    """The function's code without its docstring."""
    body = function.body[1:] if isinstance(function.body[0], ast.Expr) and isinstance(
        getattr(function.body[0], "value", None), ast.Constant) else function.body
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_every_listed_family_computes_that_loss_with_those_keys() -> None:
    reference = _body(_defs(ast.parse(_source("qwen3_moe")).body)[NAME])
    for model_type, keys in LOAD_BALANCING.items():
        source = _source(model_type)
        module = _defs(ast.parse(source).body)
        assert NAME in module and _body(module[NAME]) == reference, f"{model_type}: {NAME} is no longer Qwen3-MoE's"
        cls = _defs(module[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]].body)
        forward = ast.unparse(cls["forward"])
        assert f"{NAME}(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)" in forward \
            and "self.router_aux_loss_coef * aux_loss" in forward, f"{model_type}: another call of {NAME}"
        init = ast.unparse(cls["__init__"]).splitlines()
        for attribute, key in (("num_experts", keys.num_experts), ("num_experts_per_tok", keys.top_k),
                               ("router_aux_loss_coef", keys.coefficient)):
            assert f"self.{attribute} = config.{key}" in (line.strip() for line in init), (model_type, attribute, key)
        assert "z_loss" not in source, f"{model_type}: a router z-loss"


def test_no_causal_lm_that_computes_it_is_missing() -> None:
    """Every causal LM whose modeling file adds the loss is listed or left out on purpose."""
    calling = {model_type for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
               if f"aux_loss = {NAME}(" in (_source(model_type) if _exists(model_type) else "")}
    assert calling - set(LOAD_BALANCING) - set(NOT_LISTED) == set()
    assert set(LOAD_BALANCING) | set(NOT_LISTED) <= calling and len(calling) > 20, calling


def _exists(model_type: str) -> bool:
    module = model_type_to_module_name(model_type)
    return (Path(transformers.__file__).parent / "models" / module / f"modeling_{module}.py").is_file()


def load_balancing_loss_func(*args: object) -> None:  # the name a causal LM's forward calls (never run here)
    raise AssertionError


class _CausalLM(torch.nn.Module):
    """A stand-in for a transformers causal LM: its config, and a forward whose code names the loss or not."""

    def __init__(self, **config: object) -> None:
        super().__init__()
        self.config = SimpleNamespace(**{"output_router_logits": True, **config})


class _WithALoss(_CausalLM):
    def forward(self) -> None:
        load_balancing_loss_func()


class _WithoutALoss(_CausalLM):
    def forward(self) -> None:
        pass


def test_the_table_reads_the_keys_and_refuses_the_rest_by_name() -> None:
    """A listed model_type reads its keys (dbrx's nested); an unlisted one is refused whether its forward computes no
    router loss (the DeepSeek-V3 line records the logits only) or another one (doge's); so are numbers that are
    not."""
    moe = dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1)
    assert router_loss_of(_WithALoss(**moe)) == RouterLoss(num_experts=4, top_k=2, coefficient=0.1)
    nested = SimpleNamespace(moe_num_experts=8, moe_top_k=1, moe_loss_weight=0.01)
    assert router_loss_of(_WithALoss(model_type="dbrx", ffn_config=nested)) == RouterLoss(8, 1, 0.01)
    assert router_loss_of(_WithALoss(**{**moe, "output_router_logits": False})) is None
    for model, phrase in ((_WithoutALoss(model_type="deepseek_v3"), "_WithoutALoss \\(model_type 'deepseek_v3'\\) "
                                                                     "computes no router loss"),
                          (_WithALoss(model_type="doge"), "computes a router loss not in the trainer's table"),
                          (_WithALoss(**{**moe, "num_experts_per_tok": None}), "not the experts, the experts per")):
        with pytest.raises(ConfigError, match=f"sets output_router_logits = true, but .*{phrase}"):
            router_loss_of(model)
