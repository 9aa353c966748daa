"""The trainer on real data with a model's tokenizer: chat records and packed text, cp=2 against cp=1.

The tokenizer is the tiny model folder's (`cpcompose/integrations/transformers/tiny_model.py`); the model is the package's tiny
Llama with its 320-id vocabulary (model.name = "hf" trains the folder's own model, on the hfmodel side).

Tolerance, as in test_trainer.py: float32 sums in another order under CP (attention blocks of each document,
the loss reduction), so the curves differ in the last bits, which AdamW can grow to ~1e-7 relative over a few
steps; 1e-5 relative is far below the loss's step-to-step change (~1e-2) and far above that noise. Every
packed row mixes documents of different lengths, so a mask or position that leaked across a document or a
shard would move the loss by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpcompose.config import load_config
from cpcompose.data import build_token_stores, config_tokenizer, tokenizer_choice
from cpcompose.training.errors import TrainingError
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_data import chat_records, text_records, tiny_model_folder, tiny_tokenizer_folder, write_jsonl
from tests.support.trainer import TINY, run_trainer

HF_DATA = ["--data.source=text", f"--data.tokenizer={tiny_tokenizer_folder()}", "--model.vocab_size=320",
           "--training.steps=4"]


def losses(pools, world: int, args: list[str]) -> list[float]:
    results = pools.get(world).run(run_trainer, args)
    assert all(r == results[0] for r in results), "every rank reports the same global loss"
    return results[0]


def cp2_against_cp1(pools, tmp_path: Path, common: list[str], strategy: str) -> None:
    one = losses(pools, 1, common + [f"--job.dump_folder={tmp_path / 'one'}"])
    two = losses(pools, 2, common + ["--parallelism.cp=2", f"--parallelism.cp_strategy={strategy}",
                                     f"--job.dump_folder={tmp_path / 'two'}"])
    assert len(one) == 4 and one[0] != one[-1]  # it trained
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0)


@pytest.mark.parametrize("strategy", ["ring", "alltoall"])
def test_chat_records_train_at_cp2_as_at_cp1(pools, tmp_path: Path, strategy: str) -> None:
    """Conversations rendered with the template, loss on the assistant's tokens, rows of whole records."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(24, seed=5))
    common = HF_DATA + [f"--data.path={data}", "--data.format=chat", "--training.seq_len=128"]
    cp2_against_cp1(pools, tmp_path, common, strategy)


def test_packed_text_with_the_model_tokenizer_trains_at_cp2_as_at_cp1(pools, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", text_records(60, seed=6))
    cp2_against_cp1(pools, tmp_path, HF_DATA + [f"--data.path={data}", "--data.pack=true"], "ring")


def trainer_error(mesh, args: list[str]) -> tuple[str, int] | None:
    try:
        Trainer(load_config(TINY + args))
    except TrainingError as e:
        return str(e), e.exit_code
    return None


@pytest.mark.parametrize("store", ["true", "false"])
def test_a_bad_record_found_in_the_ranks_is_one_config_error_on_every_rank(pools, tmp_path: Path, store: str) -> None:
    """What the pre-launch check did not see (in memory: past the scan of a large corpus; a store: ranks started
    without it, which build it themselves, one after the other): each rank raises the same one-line error, exit
    code 2 (a configuration problem, printed by rank 0 only), and writes nothing into the output folder."""
    records = text_records(6)
    records[3] = {"text": ["not", "a", "string"]}
    data = write_jsonl(tmp_path / "d.jsonl", records)
    dump = tmp_path / "out"
    results = pools.get(2).run(trainer_error, HF_DATA + [f"--data.path={data}", "--parallelism.cp=2",
                                                         f"--data.store={store}", f"--job.dump_folder={dump}"])
    assert results[0] == results[1] == (f"data.path: {data}:4: 'text' is a list, expected a string", 2)
    assert not dump.exists()


def test_hf_tiny_cpu_needs_only_data_source_and_path_for_your_text(tmp_path: Path) -> None:
    """What train_configs/hf_tiny_cpu.toml's comment says: the model folder gives the tokenizer and its EOS."""
    from transformers import AutoTokenizer

    model = tiny_model_folder()
    data = write_jsonl(tmp_path / "mine.jsonl", text_records(200))
    config = load_config(["--config", str(Path(__file__).parents[4] / "train_configs" / "hf_tiny_cpu.toml"),
                          f"--model.path={model}", "--data.source=text", f"--data.path={data}"])
    assert tokenizer_choice(config).key == "model.path"
    folder = AutoTokenizer.from_pretrained(model, local_files_only=True)
    assert config_tokenizer(config).eos_id == folder.convert_tokens_to_ids("<|eos|>") == folder.eos_token_id
    (note,) = build_token_stores(config)  # the tokenizer fits the model's vocabulary, the corpus its rows
    assert note.startswith(f"token store of {data}: built "), note
