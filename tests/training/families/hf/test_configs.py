"""The Hugging Face train_configs: the CPU one trains (at 3 steps), the 128k GPU one's dry run sizes Qwen3-8B.

The CPU config is the README's "Fine-tune a Hugging Face model to long context" example; its
folder here is the one `cpcompose/integrations/transformers/tiny_model.py` writes (the README's first command). The
GPU config's dry run needs only the model's config.json (Qwen3-8B's shape, written here), not its
weights.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import transformers as hf

from cpcompose.train import main
from tests.support.hf_trainer import ROOT, make_model, train

CONFIGS = ROOT / "train_configs"


def test_the_tiny_cpu_config_trains_and_exports(pools, tmp_path: Path) -> None:
    folder = make_model(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "run" / "hf"  # the config's export_hf is relative: inside this run's dump folder
    args = ["--config", str(CONFIGS / "hf_tiny_cpu.toml"), f"--model.path={folder}", "--training.steps=3",
            "--lr_scheduler.warmup_steps=1", f"--job.dump_folder={tmp_path / 'run'}", "--metrics.plot_loss=false"]
    got = train(pools, 2, args)
    assert got["error"] is None and len(got["losses"]) == 3, got
    back = hf.AutoModelForCausalLM.from_pretrained(out)
    assert type(back).__name__ == "LlamaForCausalLM"
    assert any((tmp_path / "run" / "tb").glob("events.out.tfevents.*")), "the example writes TensorBoard"


def test_every_example_config_writes_tensorboard() -> None:
    for path in sorted(CONFIGS.glob("*.toml")):
        assert tomllib.loads(path.read_text()).get("metrics", {}).get("enable_tensorboard") is True, path.name


def test_the_qwen3_8b_128k_dry_run_needs_only_config_json(tmp_path: Path, capsys, monkeypatch) -> None:
    qwen3_8b = hf.Qwen3Config(  # Qwen/Qwen3-8B's config.json, in short
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    qwen3_8b.save_pretrained(tmp_path / "Qwen3-8B")
    monkeypatch.setenv("WORLD_SIZE", "64")
    code = main(["--config", str(CONFIGS / "hf_qwen3_8b_128k.toml"), f"--model.path={tmp_path / 'Qwen3-8B'}",
                 "--job.dry_run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cp=8" in out and "131,072 tokens per sequence" in out and "16,384 per CP rank" in out, out
    assert "Qwen3ForCausalLM" in out and "8.19B parameters" in out and "max_position_embeddings 131,072" in out
