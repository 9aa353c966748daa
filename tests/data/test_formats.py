"""The model's tokenizer and the three record formats: BOS/EOS, which tokens carry the loss, and every bad
record named by file, line and key.

The tokenizer is the tiny model's (`cpcompose/integrations/transformers/tiny_model.py`): BOS, EOS, pad and a chat template with
`{% generation %}` markers around each assistant message and its `<|end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cpcompose.config import ConfigError, load_config
from cpcompose.data import (
    ByteTokenizer,
    PretrainedTokenizer,
    build_data_source,
    build_token_stores,
    config_tokenizer,
    iter_documents,
    tokenizer_choice,
)
from tests.support.hf_data import (
    chat_records,
    tiny_model_folder,
    tiny_tokenizer_folder,
    tokenizer_variant,
    write_jsonl,
)

TOK = tiny_tokenizer_folder()


def config(path: Path, *argv: str, seq_len: int = 128, tokenizer: str | None = TOK):
    tok = [] if tokenizer is None else [f"--data.tokenizer={tokenizer}"]
    return load_config(["--data.source=text", "--data.store=false", f"--data.path={path}",  # the in-memory reading
                        f"--training.seq_len={seq_len}", "--training.batch_size=2", "--model.vocab_size=320", *tok,
                        *argv])


def hf():
    return AutoTokenizer.from_pretrained(TOK, local_files_only=True)


def documents(path: Path, *argv: str, **kwargs) -> list:
    cfg = config(path, *argv, **kwargs)
    return list(iter_documents(cfg, config_tokenizer(cfg)))


# ---- which tokenizer ---------------------------------------------------------------------------


def test_the_tokenizer_is_data_tokenizer_else_the_hf_model_folder_else_bytes(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    assert tokenizer_choice(config(data)) == (TOK, "data.tokenizer")
    assert isinstance(config_tokenizer(config(data)), PretrainedTokenizer)
    model = tiny_model_folder()
    hf_model = ["--model.name=hf", f"--model.path={model}"]
    assert tokenizer_choice(config(data, *hf_model, tokenizer=None)) == (model, "model.path")
    assert config_tokenizer(config(data, *hf_model, tokenizer=None)).eos_id == hf().eos_token_id
    assert tokenizer_choice(config(data, *hf_model)) == (TOK, "data.tokenizer")
    assert isinstance(config_tokenizer(config(data, tokenizer=None)), ByteTokenizer)
    with pytest.raises(ConfigError, match=r"^model.path: .*nowhere"):  # found by the tokenizer or the model side
        config_tokenizer(config(data, "--model.name=hf", f"--model.path={tmp_path / 'nowhere'}", tokenizer=None))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^data.tokenizer: cannot load a tokenizer from .*empty"):
        config_tokenizer(config(data, tokenizer=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match=r"^data.eos_token: only applies with a tokenizer"):
        config_tokenizer(config(data, "--data.eos_token=</s>", tokenizer=None))
    with pytest.raises(ConfigError, match=r"^data.eos_token: the tokenizer in .* has no token '<nope>'"):
        config_tokenizer(config(data, "--data.eos_token=<nope>"))
    assert config_tokenizer(config(data, "--data.eos_token=<|end|>")).eos_id == hf().convert_tokens_to_ids("<|end|>")


def test_a_tokenizer_with_more_ids_than_the_hf_model_names_the_tokenizer(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "x y z"}] * 20)
    bigger = tmp_path / "bigger"
    tok = hf()
    tok.add_tokens(["<|a|>", "<|b|>"])
    tok.save_pretrained(bigger)
    cfg = config(data, "--model.name=hf", f"--model.path={tiny_model_folder()}", "--model.vocab_size=320",
                 tokenizer=str(bigger))
    with pytest.raises(ConfigError, match=r"^data.tokenizer: the tokenizer .*bigger has 322 ids, more than the "
                                          r"model's vocabulary of 320 \(.*config.json\)"):
        build_token_stores(cfg)


# ---- text ---------------------------------------------------------------------------------------


def test_text_documents_get_the_tokenizers_bos_and_eos_and_special_strings_stay_text(tmp_path: Path) -> None:
    texts = ["hello <|eos|> world", "the fox"]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    tok = hf()
    plain = [tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in texts]
    expected = [[tok.bos_token_id, *ids, tok.eos_token_id] for ids in plain]
    assert [d.ids for d in documents(data)] == expected
    assert sum(i == tok.eos_token_id for d in expected for i in d) == 2  # the literal "<|eos|>" is text
    source = build_data_source(config(data, seq_len=4), dp_rank=0, dp_size=1).source
    assert source.tokens.tolist() == expected[0] + expected[1] and source.starts.tolist() == [0, len(expected[0])]
    no_bos = tokenizer_variant(tmp_path / "nobos", bos_token=None)
    assert [d.ids for d in documents(data, tokenizer=no_bos)] == [[*ids, tok.eos_token_id] for ids in plain]


def test_a_tokenizer_json_file_also_keeps_special_strings_as_text(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a <|eos|> b"}])
    docs = documents(data, "--data.eos_token=<|eos|>", tokenizer=f"{TOK}/tokenizer.json")
    tok = hf()  # a JSON file finds BOS by common names only (<s>, <|begin_of_text|>, ...): none here
    assert docs[0].ids[:-1] == tok("a <|eos|> b", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert docs[0].ids[-1] == tok.eos_token_id and tok.eos_token_id not in docs[0].ids[:-1]


def test_text_key_is_configurable(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"body": "abc"}])
    assert len(documents(data, "--data.text_key=body")) == 1


# ---- completion -----------------------------------------------------------------------------------


def test_completion_records_train_on_the_completion_and_eos_only(tmp_path: Path) -> None:
    records = [{"q": "what is two plus two?", "a": " four"}, {"q": "", "a": "x"}]
    data = write_jsonl(tmp_path / "c.jsonl", records)
    docs = documents(data, "--data.format=completion", "--data.prompt_key=q", "--data.completion_key=a")
    tok = hf()
    for doc, record in zip(docs, records):
        prompt, completion = (tok(record[k], add_special_tokens=False)["input_ids"] for k in ("q", "a"))
        assert doc.ids == [tok.bos_token_id, *prompt, *completion, tok.eos_token_id]
        assert doc.trained == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
        trained = [i for i, t in zip(doc.ids, doc.trained) if t]
        assert tok.decode(trained) == record["a"] + "<|eos|>"


# ---- chat -------------------------------------------------------------------------------------------


def test_chat_records_train_on_the_assistant_tokens_the_template_marks(tmp_path: Path) -> None:
    records = chat_records(5, seed=1)
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    docs = documents(data, "--data.format=chat")
    tok = hf()
    for doc, record in zip(docs, records):
        assert doc.ids == tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"]
        trained = tok.decode([i for i, t in zip(doc.ids, doc.trained) if t])
        assert trained == "".join(m["content"] + "<|end|>" for m in record["messages"] if m["role"] == "assistant")
        assert doc.ids[0] == tok.bos_token_id and tok.eos_token_id not in doc.ids  # the template's own ends
    # Rendering one message at a time finds the same tokens with this (prefix-stable) template.
    incremental = documents(data, "--data.format=chat", "--data.chat_mask=incremental")
    assert [(d.ids, d.trained) for d in incremental] == [(d.ids, d.trained) for d in docs]


def test_a_template_without_generation_markers_is_refused_unless_incremental(tmp_path: Path) -> None:
    template = hf().chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    unmarked = tokenizer_variant(tmp_path / "unmarked", chat_template=template)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(3))
    with pytest.raises(ConfigError, match=r"^data.chat_mask: the chat template in .*unmarked has no "
                                          r"\{% generation %\} markers.*data.chat_mask = 'incremental'"):
        build_token_stores(config(data, "--data.format=chat", tokenizer=unmarked))
    got = documents(data, "--data.format=chat", "--data.chat_mask=incremental", tokenizer=unmarked)
    assert [(d.ids, d.trained) for d in got] == [(d.ids, d.trained) for d in documents(data, "--data.format=chat")]


def test_incremental_refuses_a_template_that_rewrites_earlier_turns(tmp_path: Path) -> None:
    rewrites = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['role'] == 'assistant' and not loop.last"
                " %}(earlier) {% endif %}{{ m['content'] + '<|end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    folder = tokenizer_variant(tmp_path / "rewrites", chat_template=rewrites)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(1))
    with pytest.raises(ConfigError, match=r"^data.path: .*chat.jsonl:1: the chat template cannot render this record "
                                          r"\(ValueError: the chat template does not render messages\[\d\] as an "
                                          r"extension of the earlier ones"):
        documents(data, "--data.format=chat", "--data.chat_mask=incremental", tokenizer=folder)


def test_chat_needs_a_tokenizer_folder_with_a_template(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(1))
    with pytest.raises(ConfigError, match=r"^data.tokenizer: data.format = 'chat' needs a tokenizer folder"):
        build_token_stores(config(data, "--data.format=chat", tokenizer=None, ))
    bare = tokenizer_variant(tmp_path / "bare", chat_template=None)
    with pytest.raises(ConfigError, match=r"^data.tokenizer: the tokenizer in .*bare has no chat template"):
        build_token_stores(config(data, "--data.format=chat", tokenizer=bare))


# ---- bad records ---------------------------------------------------------------------------------

GOOD = {"text": {"text": "fine"}, "completion": {"prompt": "p", "completion": "c"}, "chat": chat_records(1)[0]}
USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "yo"}


@pytest.mark.parametrize("fmt,record,message", [
    ("text", {"text": 3}, r"^data.path: {f}:2: 'text' is a number \(3\), expected a string"),
    ("text", {"text": None}, r"^data.path: {f}:2: 'text' is null, expected a string"),
    ("text", {"text": True}, r"^data.path: {f}:2: 'text' is a boolean \(true\), expected a string"),
    ("text", {"text": {"a": 1}}, r"^data.path: {f}:2: 'text' is an object, expected a string"),
    ("text", {"prompt": "p", "completion": "c"},
     r"^data.text_key: {f}:2 has no 'text' field \(it has 'prompt', 'completion'\) \(it looks like data.format = "
     r"'completion', not 'text'\); fix the record or set data.text_key"),
    ("completion", {"prompt": "p", "answer": "a"},
     r"^data.completion_key: {f}:2 has no 'completion' field \(it has 'prompt', 'answer'\); fix the record or set "
     r"data.completion_key"),
    ("completion", {"prompt": ["p"], "completion": "c"}, r"^data.path: {f}:2: 'prompt' is a list, expected a string"),
    ("completion", {"text": "t"}, r"^data.prompt_key: .*looks like data.format = 'text', not 'completion'"),
    ("chat", {"text": "t"}, r"^data.messages_key: {f}:2 has no 'messages' field .*looks like data.format = 'text'"),
    ("chat", {"messages": "hi"}, r"^data.path: {f}:2: 'messages' is a string \('hi'\), expected a non-empty list"),
    ("chat", {"messages": []}, r"^data.path: {f}:2: 'messages' is an empty list, expected a non-empty list"),
    ("chat", {"messages": ["hi"]}, r"^data.path: {f}:2: messages\[0\] is a string \('hi'\), expected an object"),
    ("chat", {"messages": [USER, {"role": "bot", "content": "x"}]},
     r"^data.path: {f}:2: messages\[1\].role is 'bot', expected one of system, user, assistant, tool"),
    ("chat", {"messages": [{"content": "x"}, ANSWER]}, r"^data.path: {f}:2: messages\[0\].role is None"),
    ("chat", {"messages": [USER, {"role": "assistant", "content": ["x"]}]},
     r"^data.path: {f}:2: messages\[1\].content is a list, expected a string"),
    ("chat", {"messages": [{"role": "user"}, ANSWER]}, r"^data.path: {f}:2: messages\[0\].content is missing"),
    ("chat", {"messages": [USER]}, r"^data.path: {f}:2: no 'assistant' message, so nothing to train on"),
])
def test_a_record_that_does_not_fit_the_format_names_file_line_and_key(tmp_path: Path, fmt: str, record: dict,
                                                                       message: str) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD[fmt], record])
    with pytest.raises(ConfigError, match=message.format(f=".*d.jsonl")):
        build_token_stores(config(data, f"--data.format={fmt}"))


def test_a_txt_file_is_plain_text_only(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ConfigError, match=r"^data.format: .*a.txt is a .txt file \(plain text\), but data.format = "
                                          r"'chat' reads records from .jsonl, .parquet or .arrow files"):
        build_token_stores(config(tmp_path / "a.txt", "--data.format=chat"))


# ---- data.* keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--data.format=chat"], r"^data.format: only applies to data.source = 'text'"),
    (["--data.source=text", "--data.path=x", "--data.prompt_key=q"],
     r"^data.prompt_key: only applies to data.format = 'completion', not 'text'"),
    (["--data.source=text", "--data.path=x", "--data.format=completion", "--data.chat_mask=incremental"],
     r"^data.chat_mask: only applies to data.format = 'chat', not 'completion'"),
    (["--data.source=text", "--data.path=x", "--data.truncate=true"],
     r"^data.truncate: only applies to data.format = 'completion' or 'chat', not 'text'"),
    (["--data.source=text", "--data.path=x", "--data.format=chat", "--data.pack=false"],
     r"^data.pack: chat records are always packed whole"),
])
def test_data_keys_that_do_not_apply_are_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_records_are_packed_by_default_and_text_is_not() -> None:
    base = ["--data.source=text", "--data.path=x"]
    assert load_config(base + ["--data.format=chat"]).data.pack is True
    assert load_config(base + ["--data.format=completion"]).data.pack is True
    assert load_config(base).data.pack is False and load_config(base + ["--data.pack=true"]).data.pack is True
    assert load_config([]).data.pack is False
    assert json.dumps(load_config(base + ["--data.format=chat"]).to_dict()["data"]["pack"]) == "true"
