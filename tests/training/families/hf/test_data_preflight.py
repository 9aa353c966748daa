"""Bad data is caught before launch: one line naming the key (and the file, line or row), exit code 2, no rank
started, nothing written to the output folder (issue 22, 6b: these used to fail inside every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.train import main
from tests.support.hf_data import chat_records, text_records, tiny_tokenizer_folder, tokenizer_variant, write_jsonl
from tests.support.trainer import TINY

TWO = TINY + ["--parallelism.cp=2", "--training.steps=2", "--data.source=text", "--model.vocab_size=320"]
TOK = f"--data.tokenizer={tiny_tokenizer_folder()}"


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, the start of the one error line)."""
    write_jsonl(tmp / "short.jsonl", [{"text": "hello"}])
    write_jsonl(tmp / "nokey.jsonl", [{"text": "ok"}, {"body": "x"}])
    write_jsonl(tmp / "badrole.jsonl", [chat_records(1)[0], {"messages": [{"role": "bot", "content": "x"}]}])
    write_jsonl(tmp / "text.jsonl", text_records(3))
    (tmp / "empty.txt").write_text("")
    (tmp / "nothing").mkdir()
    (tmp / "broken.parquet").write_bytes(b"PAR1 truncated")
    unmarked = tokenizer_variant(tmp / "unmarked", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return [
        ([f"--data.path={tmp / 'short.jsonl'}", TOK], "training.seq_len: the corpus at "),
        ([f"--data.path={tmp / 'nokey.jsonl'}", TOK], f"data.text_key: {tmp / 'nokey.jsonl'}:2 has no 'text' field"),
        ([f"--data.path={tmp / 'badrole.jsonl'}", TOK, "--data.format=chat", "--training.seq_len=128"],
         f"data.path: {tmp / 'badrole.jsonl'}:2: messages[0].role is 'bot'"),
        ([f"--data.path={tmp / 'text.jsonl'}", TOK, "--data.format=completion"],
         f"data.prompt_key: {tmp / 'text.jsonl'}:1 has no 'prompt' field"),
        ([f"--data.path={tmp / 'empty.txt'}"], f"data.path: {tmp / 'empty.txt'} is empty"),
        ([f"--data.path={tmp / 'nothing'}"], "data.path: no .txt, .jsonl, .parquet files under "),
        ([f"--data.path={tmp / 'broken.parquet'}"], f"data.path: {tmp / 'broken.parquet'} is not a readable parquet"),
        ([f"--data.path={tmp / 'badrole.jsonl'}", f"--data.tokenizer={unmarked}", "--data.format=chat"],
         "data.chat_mask: the chat template in "),
        ([f"--data.path={tmp / 'text.jsonl'}", f"--data.tokenizer={tmp / 'missing'}"],
         f"data.tokenizer: {tmp / 'missing'} does not exist"),
        ([f"--data.path={tmp / 'text.jsonl'}", TOK, "--model.vocab_size=300"],
         "model.vocab_size: 300 does not cover the 320 ids of the tokenizer"),
    ]


def test_bad_data_stops_before_any_rank_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for args, start in _cases(tmp_path):
        dump = tmp_path / "out"
        assert main(TWO + [f"--job.dump_folder={dump}"] + args) == 2, args
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: {start}"), (args, out.err)
        assert "step" not in out.out, "no rank ran"
        assert not dump.exists(), "nothing written to the output folder"
