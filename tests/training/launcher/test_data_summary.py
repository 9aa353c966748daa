"""The banner's and the dry run's data lines: source, files, format, tokenizer, documents, tokens, epochs."""

from __future__ import annotations

from pathlib import Path

from cpcompose.config import load_config
from cpcompose.data import config_tokenizer
from cpcompose.data.store import cached_store_folder, store_mixture
from cpcompose.data.store.summary import summary_lines
from cpcompose.training.launcher.data_summary import DataSummary, data_lines, describe_data, summarize_data
from cpcompose.training.launcher.dry_run import describe_plan
from cpcompose.training.launcher.preflight import preflight
from tests.support.hf_trainer import hf_args, make_model, text_corpus
from tests.support.token_stores import random_lengths, store_config, write_documents


def test_a_summary_is_shown_with_its_epochs_at_this_length() -> None:
    """The hook a token store fills: 3 steps x 2 rows x 64 tokens = 384 tokens over a 1,000-token corpus."""
    config = load_config(["--training.seq_len=64", "--training.batch_size=2", "--training.steps=3"])
    lines = describe_data(DataSummary(source="text files at data/", files=("a.jsonl", "b.jsonl"), format="text",
                                      tokenizer="byte-level", documents=12, tokens=1000), config)
    assert lines[0] == "  data: text files at data/; 2 files (a.jsonl, b.jsonl); format text; tokenizer byte-level"
    assert lines[1] == "  data: 12 documents, 1,000 tokens; 3 steps x 2 x 64 tokens = 0.38 epochs at this length"


def test_one_of_a_thing_is_singular() -> None:
    """The banner said "1 documents" (issue 36); decimals stay plural ("1.00 epochs")."""
    config = load_config(["--training.seq_len=64", "--training.batch_size=1", "--training.steps=1"])
    lines = describe_data(DataSummary(source="text files at d/", files=("a.txt",), format="text",
                                      tokenizer="byte-level", documents=1, tokens=64), config)
    assert lines == ["  data: text files at d/; 1 file (a.txt); format text; tokenizer byte-level",
                     "  data: 1 document, 64 tokens; 1 step x 1 x 64 tokens = 1.00 epochs at this length"]
    (line,) = summary_lines([{"path": "d/a.txt", "store": "s/a", "documents": 1, "tokens": 1, "samples_per_epoch": 1,
                              "share": 1.0, "epochs": 1.0}])
    assert line == ("data d/a.txt: 1 document, 1 token, 1 sample an epoch, 100.0% of the mixture, 1 epoch of it in "
                    "this run (store s/a)")


def test_the_files_are_counted_and_synthetic_data_says_so(tmp_path: Path) -> None:
    model, corpus = make_model(tmp_path / "llama", "llama"), text_corpus(tmp_path, documents=60)
    summary = summarize_data(load_config(hf_args(model, corpus, tmp_path / "run")))
    assert summary.documents == 60 and summary.files == ("corpus.jsonl",), summary
    assert summary.tokens is not None and summary.tokens > 60 and summary.tokenizer == f"{model} (model.path)"
    (line,) = data_lines(load_config([]))
    assert line.startswith("  data: synthetic copy task") and "no files" in line, line


def test_token_stores_report_themselves_once_built_and_say_so_before(tmp_path: Path) -> None:
    """A dry run before the first launch does not build (it says the launch will); once built, the lines are the
    store's own counts (20 documents of 10-39 byte-level tokens), its share and epochs, and the length histogram."""
    lengths = random_lengths(20, 10, 40, seed=3)
    corpus = write_documents(tmp_path / "web" / "a.jsonl", lengths)
    config = store_config(corpus.parent, tmp_path / "stores", "--training.steps=2")
    *counted, line = data_lines(config)
    assert "not built yet" in line and f"builds it in {tmp_path / 'stores'} " in line, line
    assert "python -m cpcompose.data.build_token_store" in line and counted[1].startswith("  data: 20 documents, "), counted
    assert not (tmp_path / "stores").exists() or not any((tmp_path / "stores").iterdir())
    store_mixture(config, config_tokenizer(config), emit=None)  # what the pre-launch check does
    lines = data_lines(config, tmp_path / "lengths.png")
    assert "20 documents" in lines[0] and "100.0% of the mixture" in lines[0] and "epochs of it in this run" in lines[0], lines
    assert lines[-1].endswith("lengths.png") and (tmp_path / "lengths.png").stat().st_size > 0


def test_the_banner_says_whether_each_store_was_built_reused_or_rebuilt(tmp_path: Path) -> None:
    """What the pre-launch check did, in the launch banner (preflight -> describe_plan, as cpcompose.train does),
    with the store's folder: built, then reused at the next start, then rebuilt saying why."""
    corpus = write_documents(tmp_path / "web" / "a.jsonl", random_lengths(20, 10, 40, seed=3))
    config = store_config(corpus.parent, tmp_path / "stores", f"--job.dump_folder={tmp_path / 'out'}")
    folder = cached_store_folder(corpus.parent, config.data, tmp_path / "stores")

    def banner() -> str:
        notes: list[str] = []
        assert preflight(config, 1, data_notes=notes.append) is None
        (line,) = [line for line in describe_plan(config, 1, None, notes).splitlines() if "token store" in line]
        return line

    assert banner().startswith(f"  token store of {corpus.parent}: built {folder} in ")
    assert banner().startswith(f"  token store of {corpus.parent}: reused {folder} (built ")
    write_documents(corpus, random_lengths(20, 10, 41, seed=4))
    line = banner()
    assert line.startswith(f"  token store of {corpus.parent}: rebuilt {folder} in ")
    assert line.endswith(f": {corpus.resolve()} changed"), line
