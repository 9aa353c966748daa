"""`model.name = "hf"` refused before launch: each bad folder, override or option in one line naming the key.

`main()` runs in-process and must return 2 with one `config error: <key>` line before any rank
starts (as tests/training/launcher/test_preflight.py holds for the rest of the config). Reached inside
the ranks instead (no preflight, or a folder changed after it), the same check gives every rank
the same message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

from cpcompose.training.resolve import resolve_config
from cpcompose.config import load_config
from cpcompose.train import main
from cpcompose.training.launcher.preflight import preflight
from tests.support.hf_trainer import ROOT, hf_args, make_model, make_moe, text_corpus, train
from tests.support.hybrid_families import HYBRIDS


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"))


def _variant(llama: Path, folder: Path) -> Path:
    """A copy of the tiny llama folder, to break."""
    shutil.copytree(llama, folder)
    return folder


def _other_model(llama: Path, folder: Path, config: hf.PretrainedConfig) -> Path:
    """A tiny random model of another family, with the llama folder's tokenizer."""
    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, folder / name)
    return folder


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _without_tensor(folder: Path, name: str) -> Path:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


TINY = dict(vocab_size=320, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


PP = ["--parallelism.pp=2", "--data.pack=false", "--parallelism.pp_microbatches=2"]


def _hybrid(family: str) -> hf.PretrainedConfig:
    config = HYBRIDS[family].config()
    config.vocab_size = 320
    return config


def _cases(llama: Path, tmp: Path) -> list[tuple[Path, list[str], str, str]]:
    """(model folder, extra options, the key the error starts with, a phrase it says)."""
    empty = tmp / "empty"
    empty.mkdir()
    no_weights = _variant(llama, tmp / "no-weights")
    (no_weights / "model.safetensors").unlink()
    small = _other_model(llama, tmp / "small-vocab", hf.LlamaConfig(**{**TINY, "vocab_size": 100}))
    yarn = '--model.rope_scaling={"rope_type": "yarn"}'
    qwen3_next = make_model(tmp / "moe-ep", "qwen3_next")
    return [
        (tmp / "missing", [], "model.path", "is not a folder"),
        (empty, [], "model.path", "has no config.json"),
        (no_weights, [], "model.path", "no *.safetensors"),
        (_edit_config(_variant(llama, tmp / "unknown"), model_type="no_such_model"), [], "model.path",
         "does not load as a transformers config"),
        (_other_model(llama, tmp / "mpt", hf.MptConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=320)),
         ["--parallelism.cp=2"], "model.path", "ALiBi"),
        (_other_model(llama, tmp / "gpt2", hf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=320)),
         ["--model.rope_theta=1e6"], "model.rope_theta", "has no RoPE parameters"),
        (make_model(tmp / "gemma3", "gemma3"), ['--model.rope_scaling={"rope_type": "linear", "factor": 2.0}'],
         "model.rope_scaling", "per layer type"),
        (llama, [yarn], "model.rope_scaling", "factor"),
        (llama, ['--model.rope_scaling={"factor": 2.0}'], "model.rope_scaling", "rope_type is 'default'"),
        (llama, ["--model.rope_scaling=yarn"], "model.rope_scaling", "expected a JSON object"),
        (llama, ["--training.seq_len=8192"], "training.seq_len", "max_position_embeddings"),
        (small, [f"--data.tokenizer={llama}"], "data.tokenizer", "more than the model's vocabulary of 100"),
        (llama, ["--model.vocab_size=64"], "model.vocab_size", "does not apply"),
        (llama, ["--parallelism.tp=4"], "parallelism.tp", "4 does not divide the model's 2 kv heads"),
        (qwen3_next, ["--parallelism.tp=2"], "parallelism.tp", "Qwen3NextGatedDeltaNet (model.layers.0.linear_attn)"),
        (llama, [*PP, "--parallelism.pp_schedule=Interleaved1F1B", "--training.batch_size=4",
                 "--parallelism.pp_microbatches=4"], "parallelism.pp", "the 2 decoder layers of"),
        (llama, [*PP, "--model.n_layers=8"], "model.n_layers", "does not apply"),
        (make_model(tmp / "gemma3-tied", "gemma3"), PP, "parallelism.pp",
         "ties its input and output embeddings (tie_word_embeddings)"),
        (_other_model(llama, tmp / "zamba", _hybrid("zamba")), PP, "parallelism.pp",
         "ZambaForCausalLM (zamba) cannot be cut into pipeline stages"),
        (_other_model(llama, tmp / "nemotron", _hybrid("nemotron_h")),  # packed: its last stage, "mlp", in a region
         ["--parallelism.pp=3", "--training.batch_size=3", "--parallelism.pp_microbatches=3"], "parallelism.pp",
         "stage 2 holds feed-forward layers alone"),
        (make_moe(tmp / "moe-router", "qwen3_moe"), PP, "parallelism.pp",
         "sets output_router_logits = true, and the router loss pools every MoE layer's statistics"),
        (make_moe(tmp / "dsv3-moe", "deepseek_v3"), ["--parallelism.cp=2", "--parallelism.ep=2",
                                                     "--training.compile=true"], "training.compile",
         "not with parallelism.ep = 2"),
        (llama, [f"--checkpoint.export_hf={llama}"], "checkpoint.export_hf", "overwrite"),
        (llama, [f"--checkpoint.export_hf={_variant(llama, tmp / 'not-an-export')}"], "checkpoint.export_hf",
         "holds files no cpcompose export wrote"),
        (_other_model(llama, tmp / "neox", hf.GPTNeoXConfig(**TINY)), [], "training.fused_loss",
         "--training.fused_loss=false"),
        (_without_tensor(_variant(llama, tmp / "partial"), "model.layers.1.mlp.down_proj.weight"), [], "model.path",
         "model.layers.1.mlp.down_proj.weight: not in the checkpoint"),
        (_edit_config(make_model(tmp / "dsv3", "deepseek_v3"), output_router_logits=True), [], "model.path",
         "sets output_router_logits = true, but DeepseekV3ForCausalLM (model_type 'deepseek_v3') computes no router "
         "loss"),
        (_other_model(llama, tmp / "mixtral", hf.MixtralConfig(**TINY, num_local_experts=2, router_jitter_noise=0.01)),
         [], "model.path", "router_jitter_noise = 0.01"),
        (llama, ["--parallelism.cp=2", "--parallelism.ep=2"], "parallelism.ep", "declares no experts"),
        (qwen3_next, ["--parallelism.cp=4", "--parallelism.ep=4"], "parallelism.ep",
         "does not divide the model's 2 experts"),
        (tmp / "moe-ep", ["--parallelism.cp=2", "--training.compile=true"], "training.compile",
         "model type 'qwen3_next' (Qwen3NextForCausalLM) is not one whose decoder layers compile"),
    ]


def test_errors_found_before_any_rank_starts(llama, corpus, tmp_path: Path, capsys) -> None:
    cases = _cases(llama, tmp_path)
    for folder, extra, key, phrase in cases:
        args = hf_args(folder, corpus, tmp_path / "out", *extra)
        capsys.readouterr()
        assert main(args) == 2, (folder, extra)
        out = capsys.readouterr()
        lines = [line for line in out.err.splitlines() if "error" in line]  # (transformers' own warnings aside)
        assert len(lines) == 1 and lines[0].startswith(f"config error: {key}") and phrase in lines[0], \
            (folder, extra, out.err)
        assert "step" not in out.out, "no rank ran"


def test_the_model_path_applies_to_hf_only(tmp_path: Path, llama) -> None:
    with pytest.raises(ValueError, match="model.path: only applies to model.name = 'hf'"):
        resolve_config(load_config([f"--model.path={llama}"]))
    with pytest.raises(ValueError, match="checkpoint.export_hf: writes a Hugging Face model"):
        resolve_config(load_config([f"--checkpoint.export_hf={tmp_path}"]))


def test_a_finished_run_with_an_export_is_not_nothing_to_do(pools, llama, corpus, tmp_path: Path) -> None:
    """Preflight's "nothing to train" stop gives way to `checkpoint.export_hf` (the run resumes, exports)."""
    args = hf_args(llama, corpus, tmp_path, "--checkpoint.enable=true", steps=1)
    assert train(pools, 1, args)["error"] is None
    assert "nothing to train" in preflight(load_config(args), 1)
    assert preflight(load_config(args + [f"--checkpoint.export_hf={tmp_path / 'hf'}"]), 1) is None


def test_reached_inside_the_ranks_every_rank_says_the_same(pools, llama, corpus, tmp_path: Path) -> None:
    """No preflight (the trainer called directly): each rank refuses alike, with the pre-launch message."""
    partial = _without_tensor(_variant(llama, tmp_path / "partial"), "model.norm.weight")
    got = train(pools, 2, hf_args(partial, corpus, tmp_path / "out", "--parallelism.cp=2"))  # asserts ranks agree
    assert got["losses"] is None and got["error"].startswith("model.path:") and "model.norm.weight" in got["error"]


def test_without_transformers_the_hf_extra_is_named_in_one_line(llama, corpus, tmp_path: Path) -> None:
    """A fresh environment without the hf extra: `config error: ... pip install -e ".[hf]"`, exit 2, no traceback
    (the launch and the dry run alike). transformers' absence is simulated in one child interpreter."""
    args = hf_args(llama, corpus, tmp_path / "run")
    code = ("import sys\nsys.modules['transformers'] = None\nfrom cpcompose.train import main\n"
            f"codes = [main({args!r}), main({[*args, '--job.dry_run']!r})]\nprint(codes)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[2, 2]", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr
    assert lines[0].startswith("config error: model.name") and 'pip install -e ".[hf]"' in lines[0], lines[0]
    assert "not installed" in lines[0], lines[0]
