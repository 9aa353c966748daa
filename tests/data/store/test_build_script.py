"""scripts/build_token_store.py: builds what a config names ahead of time, prints the stores, exits 2 on bad
input with the trainer's one-line message."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.data.store import TokenStore
from tests.support.scripts import load_script
from tests.support.token_stores import write_documents



def run_script(argv: list[str]) -> int:
    return load_script("build_token_store").main(argv)


def test_the_script_builds_the_stores_and_a_bad_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [30, 40, 50])
    argv = ["--data.source=text", f"--data.path={data}", f"--data.store_dir={tmp_path / 's'}", "--data.pack=true",
            "--training.seq_len=32"]
    assert run_script([*argv, "--histogram", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"data {data}: 3 documents, 126 tokens")
    assert out[1] == f"data lengths: {tmp_path / 'h.png'}"
    folder = Path(out[2].split()[1].rstrip(":"))
    assert TokenStore(folder).num_tokens == 126 and (tmp_path / "h.png").is_file()
    assert run_script(["--data.source=text", f"--data.path={tmp_path / 'none'}", f"--data.store_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"error: data.path: {tmp_path / 'none'} does not exist\n"
