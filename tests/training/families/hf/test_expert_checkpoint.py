"""Checkpoints of an expert-parallel model move between layouts, and its export is the whole model (issue 38).

A tiny float32 Qwen3-MoE (4 experts, 2 per token, 2 MoE layers; `make_moe` with the router loss off, stored one tensor per expert)
trained 3 steps at cp = 2 x ep = 2 on 2 ranks, saving at steps 2 and 3: each rank writes its 2 experts of every
layer (and their Adam moments) at their offset in the whole stacked tensor (`ExpertShards`). Step 2 is resumed
at ep = 1 on one process (transformers' own experts module, plain tensors), at ep = 2 with each block FSDP-split
over efsdp = 2 (dp_shard = 2 x cp = 2: the split order ep first, then efsdp; swapping it moves this loss by 6e-4)
and at ep = 4 (dp_shard = 2 x cp = 2, one expert per rank); each resume's step-3 loss equals the uninterrupted
run's.

Tolerance, relative 1e-5 on the resumed step's loss: the resumed weights and moments are the saved ones bit for
bit (DCP copies), so the loss differs from the uninterrupted run's only by one float32 forward in another
layout (attention merged through its LSE, the experts' rows summed in another order, the loss's token sums):
~1e-7 relative (measured: 8.5e-8 at ep = 1, 4.2e-8 at 4 ranks); an expert read from another's rows, or a
routing choice flipped, moves it by orders more. The exports are exact: the ep = 2 run's into the source's
per-expert tensors, the efsdp = 2 resume's (model.path a copy of the folder with the experts stored stacked,
the same weights) into stacked ones; `from_pretrained` reloads each equal to the trained model gathered whole, and
computes the same logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.support.hf_trainer import hf_args, make_moe, same_logits, text_corpus, train

RTOL = 1e-5
CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]
EP2 = ["--parallelism.cp=2", "--parallelism.ep=2"]


def _stacked_copy(folder: Path, to: Path) -> Path:
    """`folder` with its experts stored stacked (the model's own `gate_up_proj`, `down_proj`): the same weights."""
    shutil.copytree(folder, to)
    assert not (to / "model.safetensors.index.json").exists()
    state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, to / "model.safetensors", metadata={"format": "pt"})
    return to


def _stored(folder: Path) -> set[str]:
    """The tensor names a folder stores."""
    return set(load_file(folder / "model.safetensors")) if (folder / "model.safetensors").exists() else \
        set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def test_saved_at_ep2_resumes_in_other_layouts_and_exports(pools, tmp_path: Path) -> None:
    moe, corpus = make_moe(tmp_path / "qwen3_moe", output_router_logits=False), text_corpus(tmp_path)
    out = tmp_path / "exported"
    full = train(pools, 2, hf_args(moe, corpus, tmp_path / "run", *EP2, *CKPT, f"--checkpoint.export_hf={out}",
                                   steps=3), weights=True)
    assert full["error"] is None, full["error"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-2", "step-3"]

    def resume(world: int, name: str, *extra: str, model: Path = moe, weights: bool = False) -> dict:
        dump = tmp_path / name
        shutil.copytree(tmp_path / "run" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
        got = train(pools, world, hf_args(model, corpus, dump, *extra, *CKPT, steps=3), weights=weights)
        assert got["error"] is None, got["error"]
        assert got["losses"] == pytest.approx(full["losses"][2:], rel=RTOL), (name, got["losses"], full["losses"])
        return got

    resume(1, "ep1")
    resume(4, "ep4", "--parallelism.dp_shard=2", "--parallelism.cp=2", "--parallelism.ep=4")
    stacked = _stacked_copy(moe, tmp_path / "stacked")
    out_efsdp = tmp_path / "exported-efsdp2"
    efsdp = resume(4, "efsdp2", "--parallelism.dp_shard=2", "--parallelism.cp=2", "--parallelism.ep=2",
                   f"--checkpoint.export_hf={out_efsdp}", model=stacked, weights=True)

    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in _stored(out)  # the source's layout, each expert
    assert not any("gate_up_proj" in k for k in _stored(out))
    same_logits(full["weights"], moe, out)
    assert "model.layers.1.mlp.experts.gate_up_proj" in _stored(out_efsdp)  # the stacked copy's layout
    same_logits(efsdp["weights"], stacked, out_efsdp)
