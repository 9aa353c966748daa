"""A model's own tokenizer, from its folder: BOS/EOS as it defines them, and its chat template with the
assistant's tokens marked.

transformers is imported only here, and only when a folder is given; nothing is fetched (local files only).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from cpcompose.config import ConfigError

__all__ = ["ChatMask", "PretrainedTokenizer", "has_generation_markers"]

ChatMask = Literal["generation", "incremental"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str) -> bool:
    """Whether a chat template marks the assistant's output with ``{% generation %}`` (transformers' convention)."""
    return _GENERATION.search(template) is not None


class PretrainedTokenizer:
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` behind the text source's protocol.

    BOS is put before a document when the tokenizer defines one (``bos_token``), EOS after it (``eos_token``,
    or ``eos_token`` given here). Plain text is encoded with special-token strings split (a literal
    "<|endoftext|>" in a web page stays text, never an end of document); chat templates are rendered with
    their specials, as the model saw them.
    """

    def __init__(self, folder: str, *, eos_token: str | None = None, key: str = "data.tokenizer") -> None:
        """Load the tokenizer in ``folder``.

        Raises:
            ConfigError: it does not load (names ``key``), or has no EOS (names data.eos_token).
        """
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ConfigError(f"{key}: a tokenizer folder needs transformers: pip install transformers") from e
        try:
            self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:  # missing files, unknown class, malformed JSON
            raise ConfigError(f"{key}: cannot load a tokenizer from {folder} ({type(e).__name__}: {e})") from None
        self.folder, self.key = folder, key
        self.vocab_size: int = len(self._tok)  # added tokens included
        self.bos_id: int | None = self._tok.bos_token_id
        self.pad_id: int | None = self._tok.pad_token_id
        eos = self._tok.eos_token_id if eos_token is None else self._tok.convert_tokens_to_ids(eos_token)
        if eos is None or (eos_token is not None and eos == self._tok.unk_token_id):
            what = f"no token {eos_token!r}" if eos_token is not None else "no eos_token"
            raise ConfigError(f"data.eos_token: the tokenizer in {folder} has {what}; set data.eos_token")
        self.eos_id: int = eos
        self._plain = self._plain_text_encoder()

    def _plain_text_encoder(self) -> Any:
        """A copy of the Rust tokenizer that encodes special-token strings as text (None for a Python-only one).

        A copy, so chat rendering keeps its specials; called directly, it is several times faster than going
        through transformers' ``__call__``, which matters for the pre-launch scan."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @property
    def chat_template(self) -> str | None:
        """The default chat template, if the folder has one."""
        template = self._tok.chat_template
        return template.get("default") if isinstance(template, dict) else template

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: no BOS/EOS added, special-token strings in it encoded as text."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in one call."""
        if not texts:  # transformers fails on an empty batch
            return []
        if self._plain is not None:
            return [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)]
        return self._tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat_problem(self, mask: ChatMask) -> str | None:
        """Why this tokenizer cannot render chat records with ``mask``, naming the key to change, or None."""
        template = self.chat_template
        if template is None:
            return f"{self.key}: the tokenizer in {self.folder} has no chat template, which data.format = 'chat' needs"
        if mask == "generation" and not has_generation_markers(template):
            return (f"data.chat_mask: the chat template in {self.folder} has no {{% generation %}} markers, so the "
                    "assistant's tokens cannot be told apart; use a template with them, or set data.chat_mask = "
                    "'incremental' (renders the conversation one message at a time)")
        return None

    def chat(self, messages: list[dict[str, Any]], mask: ChatMask) -> tuple[list[int], list[bool]]:
        """The conversation's ids and, per id, whether the assistant wrote it (those carry the loss).

        Raises:
            ValueError: the template fails on it, or (incremental) does not render it as a growing prefix.
        """
        if mask == "generation":
            out = self._tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        text = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = self._render(messages[:i], prompt=True), self._render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"the chat template does not render messages[{i}] as an extension of the earlier "
                                 "ones (it rewrites earlier turns), so data.chat_mask = 'incremental' cannot find "
                                 "the assistant's tokens; use a template with {% generation %} markers")
            spans.append((len(before), len(upto)))
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), trained

    def _render(self, messages: list[dict[str, Any]], *, prompt: bool = False) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
