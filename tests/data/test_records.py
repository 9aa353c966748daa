"""cpcompose.data.records: .txt, .jsonl, .parquet, .arrow (datasets' save_to_disk) and folders read record by record, every problem named."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cpcompose.config import ConfigError
from cpcompose.data import data_files, iter_records
from tests.support.hf_data import write_jsonl


def read(path: Path, **kwargs) -> list:
    return list(iter_records(data_files(path), **kwargs))


def test_parquet_rows_are_records_with_their_row_numbers(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a", "b", "c"], "id": [1, 2, 3]}), tmp_path / "t.parquet")
    records = read(tmp_path / "t.parquet")
    assert [r.value for r in records] == [{"text": "a", "id": 1}, {"text": "b", "id": 2}, {"text": "c", "id": 3}]
    assert records[2].where == f"{tmp_path / 't.parquet'} row 3"
    messages = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "chat.parquet")  # a list of structs
    assert read(tmp_path / "chat.parquet")[0].value == {"messages": messages[0]}


def test_a_folder_mixes_the_three_formats_in_sorted_order_and_a_limit_reads_the_first_of_each(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("one")
    write_jsonl(tmp_path / "b" / "x.jsonl", [{"text": "two"}, {"text": "three"}])
    pq.write_table(pa.table({"text": ["four", "five"]}), tmp_path / "c.parquet")
    values = [r.value if isinstance(r.value, str) else r.value["text"] for r in read(tmp_path)]
    assert values == ["one", "two", "three", "four", "five"]
    limited = [r.value if isinstance(r.value, str) else r.value["text"] for r in read(tmp_path, limit_per_file=1)]
    assert limited == ["one", "two", "four"]


@pytest.mark.parametrize("name,content,message", [
    ("empty.txt", b"  \n", r"^data.path: .*empty.txt is empty"),
    ("blank.jsonl", b"\n\n", r"^data.path: .*blank.jsonl holds no records"),
    ("binary.txt", bytes(range(256)), r"^data.path: .*binary.txt is not UTF-8 text \(byte 128\)"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": \n', r"^data.path: .*bad.jsonl:2: invalid JSON"),
    ("list.jsonl", b'{"text": "ok"}\n["text"]\n', r"^data.path: .*list.jsonl:2: expected a JSON object, got list"),
    ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"^data.path: .*latin1.jsonl:2 is not UTF-8"),
    ("broken.parquet", b"PAR1 not really", r"^data.path: .*broken.parquet is not a readable parquet file"),
    ("notes.md", b"# hi", r"^data.path: .*notes.md is not a .txt, .jsonl, .parquet file"),
])
def test_bad_files_name_the_file_and_line(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read(tmp_path / name)


def test_an_empty_parquet_file_and_an_empty_folder_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(ConfigError, match=r"^data.path: .*none.parquet holds no records \(0 rows\)"):
        read(tmp_path / "none.parquet")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "readme.md").write_text("not data")
    with pytest.raises(ConfigError, match=r"^data.path: no .txt, .jsonl, .parquet files under .*folder"):
        read(tmp_path / "folder")


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` fail
    with pytest.raises(ConfigError, match=r"^data.path: .*t.parquet is a .parquet file, which needs pyarrow: "
                                          r"pip install pyarrow"):
        read(tmp_path / "t.parquet")


def test_a_dataset_saved_with_save_to_disk_is_read_row_by_row(tmp_path: Path) -> None:
    import datasets  # the test extra has it; the reader itself needs only pyarrow
    rows = [{"text": "first"}, {"text": "second"}, {"text": "third"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    records = read(tmp_path / "saved")
    assert [r.value for r in records] == rows and records[1].where.endswith(".arrow row 2")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ConfigError, match=r"^data.path: .*splits holds several splits .* e.g. .*splits/train$"):
        read(tmp_path / "splits")


def test_a_large_txt_file_is_read_in_parts_cut_at_line_breaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cpcompose.data.records as records

    monkeypatch.setattr(records, "TXT_PART_BYTES", 10)
    text = "ab\ncdefghijkl\nmnopé\nqrstuvwxyz0123\n"
    (tmp_path / "big.txt").write_text(text)
    parts = read(tmp_path / "big.txt")
    assert "".join(p.value for p in parts) == text and all(p.value.endswith("\n") for p in parts)
    assert [p.number for p in parts] == list(range(1, len(parts) + 1)) and len(parts) > 1
    assert parts[1].where == f"{tmp_path / 'big.txt'} part 2"
