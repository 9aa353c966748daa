"""`python -m cpcompose.data.build_token_store` (the `cpcompose-build-token-store` command): builds what a config
names ahead of time, prints the stores, exits 2 on bad input with the trainer's one-line message."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.data.build_token_store import main
from cpcompose.data.store import TokenStore
from tests.support.token_stores import write_documents


def test_the_command_builds_the_stores_and_a_bad_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = write_documents(tmp_path / "d" / "a.jsonl", [30, 40, 50])
    argv = ["--data.source=text", f"--data.path={data}", f"--data.store_dir={tmp_path / 's'}", "--data.pack=true",
            "--training.seq_len=32"]
    assert main([*argv, "--histogram", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"data {data}: 3 documents, 126 tokens")
    assert out[1] == f"data lengths: {tmp_path / 'h.png'}"
    folder = Path(out[2].split()[1].rstrip(":"))
    assert TokenStore(folder).num_tokens == 126 and (tmp_path / "h.png").is_file()
    assert main(["--data.source=text", f"--data.path={tmp_path / 'none'}", f"--data.store_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"error: data.path: {tmp_path / 'none'} does not exist\n"
