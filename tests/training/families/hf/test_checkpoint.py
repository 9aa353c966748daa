"""Hugging Face models out of the trainer: DCP resume, and `checkpoint.export_hf` back to from_pretrained.

Gemma 3 ties its output layer to its embedding (stored once, a buffer `embed_scale` in no
checkpoint), Qwen3-Next stacks its experts (stored one tensor per expert): the two ways a model's
tensors differ from its checkpoint's. Resuming in the same layout is bit-exact; into another
layout (cp=2 -> cp=1) within the trainer's float32 tolerance (tests/training/families/hf/test_trainer.py).
An export holds the trained weights exactly (same dtype, float32), and the model
`from_pretrained` builds from it computes the same logits as the trained weights in the source
model's class.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from cpcompose.training.families.export import MARKER
from tests.support.hf_trainer import hf_args, make_model, reference_first_loss, same_logits, text_corpus, train

CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"))


def test_tied_model_resumes_exactly_and_exports(pools, corpus, tmp_path: Path) -> None:
    source = make_model(tmp_path / "gemma3", "gemma3")
    out = tmp_path / "exported"
    full = train(pools, 2, hf_args(source, corpus, tmp_path / "run", "--parallelism.cp=2", *CKPT,
                                   f"--checkpoint.export_hf={out}"), weights=True)
    assert full["error"] is None, full["error"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-2", "step-4"]

    def resume(world: int, name: str, *extra: str) -> list[float]:
        dump = tmp_path / name
        shutil.copytree(tmp_path / "run" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
        got = train(pools, world, hf_args(source, corpus, dump, *extra, *CKPT))
        assert got["error"] is None, got["error"]
        return got["losses"]

    assert resume(2, "same", "--parallelism.cp=2") == full["losses"][2:]  # bit-exact
    torch.testing.assert_close(torch.tensor(resume(1, "cp1")), torch.tensor(full["losses"][2:]), rtol=1e-5, atol=0)

    files = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in files and "chat_template.jinja" in files and "sharded" not in files, files
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    same_logits(full["weights"], source, out)


def test_stacked_experts_export_and_context_overrides(pools, corpus, tmp_path: Path) -> None:
    """Qwen3-Next's per-expert tensors written back from the stacked ones; the RoPE overrides in config.json
    and in the training itself (step 1 equals transformers' loss under the overridden config, not the original)."""
    source = make_model(tmp_path / "qwen3_next", "qwen3_next")
    out = tmp_path / "exported"
    overrides = ["--model.rope_theta=50000", "--model.max_position_embeddings=8192",
                 '--model.rope_scaling={"rope_type": "yarn", "factor": 2.0}']
    args = hf_args(source, corpus, tmp_path / "run", "--parallelism.cp=2", f"--checkpoint.export_hf={out}",
                   *overrides)
    run = train(pools, 2, args, weights=True)
    assert run["error"] is None, run["error"]

    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("yarn", 2.0, 50000.0), rope
    assert rope["original_max_position_embeddings"] == 4096 and config["max_position_embeddings"] == 8192
    stored = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.1.gate_proj.weight" in stored and not any("gate_up_proj" in k for k in stored)
    same_logits(run["weights"], source, out)

    extended = AutoConfig.from_pretrained(source)  # what the overrides mean, said with transformers alone
    extended.rope_parameters = {**extended.rope_parameters, "rope_type": "yarn", "factor": 2.0, "rope_theta": 50000.0,
                                "original_max_position_embeddings": 4096}
    extended.max_position_embeddings = 8192
    assert run["losses"][0] == pytest.approx(reference_first_loss(args, extended), rel=1e-6)
    assert run["losses"][0] != pytest.approx(reference_first_loss(args), rel=1e-6)  # the overrides took effect


def test_export_of_a_finished_run_resumes_and_only_exports(pools, corpus, tmp_path: Path) -> None:
    """`--checkpoint.export_hf` on a run already at training.steps: no step is trained, the model is written."""
    source = make_model(tmp_path / "llama", "llama")
    first = train(pools, 1, hf_args(source, corpus, tmp_path / "run", *CKPT, steps=2), weights=True)
    out = tmp_path / "run" / "hf"  # a relative export_hf lies inside job.dump_folder
    again = train(pools, 1, hf_args(source, corpus, tmp_path / "run", *CKPT, "--checkpoint.export_hf=hf",
                                    steps=2), weights=True)
    assert again["losses"] == [] and again["error"] is None, again
    same_logits(first["weights"], source, out)
    assert json.loads((out / MARKER).read_text())["dump_folder"] == str((tmp_path / "run").resolve())
