"""Tokenizers for the text source: byte-level (no dependency), a `tokenizers` JSON file, or a model's tokenizer
folder (:mod:`cpcompose.data.pretrained`); and which one a config means, decided here only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.pretrained import PretrainedTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerChoice", "build_tokenizer", "config_tokenizer",
           "tokenizer_choice"]

_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


class Tokenizer(Protocol):
    """What the text source needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    """Put before each document when not None."""
    eos_id: int
    """Put after each text document and completion (not after a chat: its template ends the turns)."""
    pad_id: int | None
    """Fills the end of a packed row of records (no loss, its own document); None uses eos_id."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text (one call, so a Rust tokenizer can take them together)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255, then BOS = 256 and EOS = 257: needs no file and covers any text."""

    vocab_size: int = 258
    bos_id: int | None = 256
    eos_id: int = 257
    pad_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The UTF-8 bytes of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; BOS/EOS dropped, invalid UTF-8 replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` JSON file (e.g. Llama 3's tokenizer.json); the library is imported only here."""

    def __init__(self, path: str, *, eos_token: str | None = None) -> None:
        """Load ``path``; find EOS by ``eos_token`` or, if None, by common names.

        Raises:
            ConfigError: the `tokenizers` package is missing, the file cannot be loaded or has no EOS token (names
                data.tokenizer / data.eos_token).
        """
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ConfigError("data.tokenizer: a tokenizer.json file needs the `tokenizers` package: pip install "
                              "tokenizers (or leave data.tokenizer unset for byte-level tokens)") from None
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for missing or malformed files
            raise ConfigError(f"data.tokenizer: cannot load {path!r}: {e}") from None
        self._tok.encode_special_tokens = True  # a literal "</s>" in a document is text, not its end
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id: int | None = self._first_id(_BOS_NAMES)
        eos = self._first_id((eos_token,) if eos_token is not None else _EOS_NAMES)
        if eos is None:
            tried = eos_token if eos_token is not None else ", ".join(_EOS_NAMES)
            raise ConfigError(f"data.eos_token: {path} has no token {tried}; set data.eos_token")
        self.eos_id: int = eos
        self.pad_id: int | None = None

    def _first_id(self, names: Sequence[str]) -> int | None:
        ids = [self._tok.token_to_id(name) for name in names]
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the file's post-processor specials (the source adds BOS/EOS itself)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in one call."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


class TokenizerChoice(NamedTuple):
    """Which tokenizer a config means, and the key that chose it (errors name that key)."""

    path: str | None
    """A folder, a JSON file, or None for byte-level."""
    key: str
    """``data.tokenizer`` or ``model.path``."""


def tokenizer_choice(config: JobConfig) -> TokenizerChoice:
    """The one place that decides the data's tokenizer: ``data.tokenizer`` when set, else the model folder's
    (``model.path``, for a family that reads its model from a folder; the others refuse the key), else
    byte-level."""
    if config.data.tokenizer is not None:
        return TokenizerChoice(config.data.tokenizer, "data.tokenizer")
    if config.model.path is not None:
        return TokenizerChoice(config.model.path, "model.path")
    return TokenizerChoice(None, "data.tokenizer")


def build_tokenizer(path: str | None, *, eos_token: str | None = None, key: str = "data.tokenizer") -> Tokenizer:
    """Byte-level when ``path`` is None, a folder's tokenizer (:class:`PretrainedTokenizer`), else
    :class:`HFTokenizer` over the JSON file.

    Raises:
        ConfigError: naming ``key`` (the path does not exist or does not load) or data.eos_token.
    """
    if path is None:
        if eos_token is not None:
            raise ConfigError("data.eos_token: only applies with a tokenizer (data.tokenizer, or model.path of "
                              "model.name = 'hf'); the byte-level tokenizer's EOS is fixed")
        return ByteTokenizer()
    if Path(path).is_dir():
        return PretrainedTokenizer(path, eos_token=eos_token, key=key)
    if not Path(path).is_file():
        raise ConfigError(f"{key}: {path} does not exist")
    return HFTokenizer(path, eos_token=eos_token)


def config_tokenizer(config: JobConfig) -> Tokenizer:
    """The tokenizer ``config`` means (see :func:`tokenizer_choice`)."""
    choice = tokenizer_choice(config)
    return build_tokenizer(choice.path, eos_token=config.data.eos_token, key=choice.key)
