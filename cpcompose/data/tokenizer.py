"""Tokenizers for the text source: byte-level (no dependency) or a `tokenizers` JSON file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cpcompose.config import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "build_tokenizer"]

_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


class Tokenizer(Protocol):
    """What the text source needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255, then BOS = 256 and EOS = 257: needs no file and covers any text."""

    vocab_size: int = 258
    bos_id: int | None = 256
    eos_id: int = 257

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; BOS/EOS dropped, invalid UTF-8 replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` JSON file (e.g. Llama 3's tokenizer.json); the library is imported only here."""

    def __init__(self, path: str, *, eos_token: str | None = None) -> None:
        """Load ``path``; find EOS by ``eos_token`` or, if None, by common names.

        Raises:
            ImportError: the `tokenizers` package is missing.
            ConfigError: the file cannot be loaded or has no EOS token (names data.tokenizer / data.eos_token).
        """
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError("data.tokenizer needs the `tokenizers` package: pip install tokenizers "
                              "(or leave data.tokenizer unset for byte-level tokens)") from e
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for missing or malformed files
            raise ConfigError(f"data.tokenizer: cannot load {path!r}: {e}") from None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id: int | None = self._first_id(_BOS_NAMES)
        eos = self._first_id((eos_token,) if eos_token is not None else _EOS_NAMES)
        if eos is None:
            tried = eos_token if eos_token is not None else ", ".join(_EOS_NAMES)
            raise ConfigError(f"data.eos_token: {path} has no token {tried}; set data.eos_token")
        self.eos_id: int = eos

    def _first_id(self, names: Sequence[str]) -> int | None:
        ids = [self._tok.token_to_id(name) for name in names]
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the file's post-processor specials (the source adds BOS/EOS itself)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def build_tokenizer(path: str | None, *, eos_token: str | None = None) -> Tokenizer:
    """Byte-level when ``path`` is None, else :class:`HFTokenizer` over the JSON file."""
    return ByteTokenizer() if path is None else HFTokenizer(path, eos_token=eos_token)
