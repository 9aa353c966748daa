"""Records to token documents, by data.format: plain text, prompt/completion, or chat messages.

A :class:`Document` is the ids of one record and which of them carry the loss. Every record is checked
against its format here, so the pre-launch scan and the ranks raise the same ConfigError, naming the file,
the line or row, and the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cpcompose.config import ConfigError, Data
from cpcompose.data.pretrained import PretrainedTokenizer
from cpcompose.data.records import Record
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["CHAT_ROLES", "Document", "Format", "RecordReader", "record_too_long"]

Format = Literal["text", "completion", "chat"]

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""Message roles a chat record may use (what chat templates commonly render)."""


@dataclass(frozen=True)
class Document:
    """One record's tokens."""

    ids: list[int]
    trained: list[bool] | None
    """Per id, whether it is a target (predicted from the id before it); None: every id is (plain text)."""
    where: str
    """The record's file and line/row, for errors raised after tokenizing (too long, nothing to train)."""


def record_too_long(where: str, tokens: int, seq_len: int) -> ConfigError:
    """The error for a completion/chat record longer than a row without data.truncate."""
    return ConfigError(f"training.seq_len: {where}: the record has {tokens} tokens, more than training.seq_len = "
                       f"{seq_len}; raise training.seq_len, shorten the record, or set data.truncate = true (keeps "
                       "its first training.seq_len tokens)")


class RecordReader:
    """Turns records into documents as ``data`` (format, keys, chat_mask) says, with ``tokenizer``.

    text: ``[BOS] text EOS``; completion: ``[BOS] prompt completion EOS`` with the loss on completion and EOS;
    chat: the tokenizer's chat template applied to the messages, the loss on the assistant's tokens (no BOS or
    EOS added: the template places its own).
    """

    def __init__(self, data: Data, tokenizer: Tokenizer) -> None:
        """Raises:
            ConfigError: chat records with a tokenizer that has no chat template, or no generation markers
            when data.chat_mask = "generation"."""
        self.data, self.tokenizer = data, tokenizer
        self.format: Format = data.format
        self._bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        if self.format == "chat":
            if not isinstance(tokenizer, PretrainedTokenizer):
                raise ConfigError("data.tokenizer: data.format = 'chat' needs a tokenizer folder with a chat template "
                                  "(e.g. the model's folder), not a tokenizer.json file or the byte-level default")
            if (problem := tokenizer.chat_problem(data.chat_mask)) is not None:
                raise ConfigError(problem)

    def texts(self, record: Record) -> list[str]:
        """The strings a text or completion record holds, checked (a chat record: none)."""
        d, value = self.data, record.value
        if record.file.suffix == ".txt":
            if self.format != "text":
                raise ConfigError(f"data.format: {record.where} is a .txt file (plain text), but data.format = "
                                  f"{self.format!r} reads records from .jsonl, .parquet or .arrow files")
            return [value]
        names = {"text": ["text_key"], "completion": ["prompt_key", "completion_key"], "chat": []}[self.format]
        return [self._string(record, name) for name in names]

    def document(self, record: Record, encoded: list[list[int]]) -> Document:
        """The record as a document; ``encoded`` is the tokenizer's ids of :meth:`texts` (a text's list is taken
        over, BOS and EOS put into it in place: a long document's ids are never copied)."""
        eos = [self.tokenizer.eos_id]
        if self.format == "text":
            ids = encoded[0]
            ids[:0] = self._bos
            ids += eos
            return Document(ids, None, record.where)
        if self.format == "completion":
            prompt, completion = encoded
            ids = self._bos + prompt + completion + eos
            return Document(ids, [False] * (len(self._bos) + len(prompt)) + [True] * (len(completion) + 1),
                            record.where)
        messages = self._messages(record)
        assert isinstance(self.tokenizer, PretrainedTokenizer)
        try:
            ids, trained = self.tokenizer.chat(messages, self.data.chat_mask)
        except Exception as e:  # jinja raises its own errors from inside the template (raise_exception, ...)
            raise ConfigError(f"data.path: {record.where}: the chat template cannot render this record "
                              f"({type(e).__name__}: {e})") from None
        if not any(trained[1:]):
            raise ConfigError(f"data.chat_mask: {record.where}: the chat template marks none of this record's tokens "
                              "as the assistant's; check its {% generation %} markers or data.chat_mask")
        return Document(ids, trained, record.where)

    def _string(self, record: Record, which: str) -> str:
        value, key = record.value, getattr(self.data, which)
        if key not in value:
            raise ConfigError(f"data.{which}: {record.where} has no {key!r} field (it has {_keys(value)})"
                              f"{self._hint(value)}; fix the record or set data.{which}")
        if not isinstance(value[key], str):
            raise ConfigError(f"data.path: {record.where}: {key!r} is {_kind(value[key])}, expected a string")
        return value[key]

    def _messages(self, record: Record) -> list[dict[str, Any]]:
        key, value = self.data.messages_key, record.value
        if key not in value:
            raise ConfigError(f"data.messages_key: {record.where} has no {key!r} field (it has {_keys(value)})"
                              f"{self._hint(value)}; fix the record or set data.messages_key")
        messages = value[key]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"data.path: {record.where}: {key!r} is {_kind(messages)}, expected a non-empty list "
                              "of {role, content} objects")
        for i, m in enumerate(messages):
            at = f"data.path: {record.where}: {key}[{i}]"
            if not isinstance(m, dict):
                raise ConfigError(f"{at} is {_kind(m)}, expected an object with 'role' and 'content'")
            if m.get("role") not in CHAT_ROLES:
                raise ConfigError(f"{at}.role is {m.get('role')!r}, expected one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                got = "missing" if "content" not in m else _kind(m["content"])
                raise ConfigError(f"{at}.content is {got}, expected a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"data.path: {record.where}: no 'assistant' message, so nothing to train on")
        return messages

    def _hint(self, value: dict) -> str:
        """Which format a record that lacks this format's key looks like."""
        d = self.data
        looks = ("text" if d.text_key in value and self.format != "text" else
                 "completion" if d.prompt_key in value and d.completion_key in value and self.format != "completion"
                 else "chat" if d.messages_key in value and self.format != "chat" else None)
        return f" (it looks like data.format = {looks!r}, not {self.format!r})" if looks else ""


def _keys(value: dict) -> str:
    return ", ".join(map(repr, list(value)[:8])) + (", ..." if len(value) > 8 else "") if value else "no fields"


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (`'text' is a number (3)`, never Python's "a int")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:20]!r}{'...' if len(value) > 20 else ''})"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
