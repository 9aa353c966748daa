"""[[data.sources]]: read from TOML and the command line, completed with defaults, and every bad table refused
naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.config import ConfigError, load_config

TEXT = ["--data.source=text", "--data.store_dir=stores"]


def test_sources_from_toml_get_their_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\nsource = "text"\nstore_dir = "s"\n[[data.sources]]\npath = "a"\nweight = 3\n'
                    '[[data.sources]]\npath = "b"\nlong_doc_tokens = 100\nlong_doc_repeat = 2\n')
    assert load_config(["--config", str(toml)]).data.sources == [
        {"path": "a", "weight": 3.0, "long_doc_tokens": None, "long_doc_repeat": 1},
        {"path": "b", "weight": 1.0, "long_doc_tokens": 100, "long_doc_repeat": 2}]


def test_a_mixture_needs_no_store_dir_and_an_empty_one_in_toml_is_refused(tmp_path: Path) -> None:
    """Token stores are the default (kept in the per-user cache, which the data layer finds, not the config)."""
    cfg = load_config(["--data.source=text", '--data.sources=[{"path": "a"}]'])
    assert cfg.data.store and cfg.data.store_dir is None
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\nsource = "text"\npath = "a"\nstore_dir = ""\n')
    with pytest.raises(ConfigError, match=r"^data.store_dir: is empty"):
        load_config(["--config", str(toml)])


def test_sources_on_the_command_line_are_json() -> None:
    cfg = load_config([*TEXT, '--data.sources=[{"path": "a", "weight": 0.25}]'])
    assert cfg.data.sources == [{"path": "a", "weight": 0.25, "long_doc_tokens": None, "long_doc_repeat": 1}]


@pytest.mark.parametrize(("argv", "message"), [
    (["--data.path=x", '--data.sources=[{"path": "a"}]'],
     r"^data.path: required when data.source = 'text', unless \[\[data.sources\]\] lists the sources \(not both\)"),
    (["--data.source=text", "--data.store=false", '--data.sources=[{"path": "a"}]'],
     r"^data.store: false tokenizes one data.path in memory, but \[\[data.sources\]\] is a mixture of token stores"),
    (['--data.sources=[{"path": "a", "wieght": 2}]'], r"^data.sources\[0\]: unknown key\(s\) wieght"),
    (['--data.sources=[{"path": "a"}, {"path": "b", "weight": 0}]'], r"^data.sources\[1\].weight: must be a positive"),
    (['--data.sources=[{"weight": 1}]'], r"^data.sources\[0\].path: required"),
    (['--data.sources=["a"]'], r"^data.sources\[0\]: must be a table"),
    (['--data.sources=[{"path": "a", "long_doc_repeat": 2}]'], r"^data.sources\[0\].long_doc_repeat: needs "
                                                               r"long_doc_tokens"),
    (["--data.source=synthetic", "--data.store_dir=s"], r"^data.store_dir: only applies to data.source = 'text'"),
    (["--data.source=synthetic", "--data.store=false"], r"^data.store: only applies to data.source = 'text'"),
    (["--data.source=text", "--data.path=x", "--data.store_dir="],
     r"^data.store_dir: is empty: give a folder for the token stores, or leave it unset to keep them in the "
     r"per-user cache, or set data.store = false to tokenize in memory$"),
    (["--data.source=text", "--data.path=x", "--data.store_dir=s", "--data.store=false"],
     r"^data.store_dir: is where token stores go, but data.store = false tokenizes in memory"),
])
def test_bad_sources_name_the_key(argv: list[str], message: str) -> None:
    base = [] if any(a.startswith("--data.source=") for a in argv) else TEXT
    with pytest.raises(ConfigError, match=message):
        load_config([*base, *argv])
