"""The dialog's tokenizer (Hugging Face `tokenizers`, tokenizer.json) and streaming decode.

A token may end inside a UTF-8 character (byte-level BPE splits emoji and CJK over several tokens):
streamed text holds such bytes back until the character is whole, so what is printed never changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from quiver.errors import DialogConfigError


def is_utf8(text: str) -> bool:
    """Whether `text` can be UTF-8, as a tokenizer needs: no lone surrogates (Python keeps undecodable
    command-line bytes as them; JSON's \\ud800 escapes give them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise DialogConfigError(f"{path}: not a tokenizer.json the tokenizers library reads ({exc})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` False for text that has them already (a rendered chat
        template: transformers' apply_chat_template tokenizes it so)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what a grammar engine reads)."""
        return str(self._tokenizer.to_str())

    def token_text(self, token: int) -> str:
        """One token's text, a special token's written out (a log-probability's label)."""
        return str(self._tokenizer.decode([token], skip_special_tokens=False))

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Turns tokens into text pieces as they come: each piece is final (no partial characters).

    Decodes a short window (the tokens since the last piece and the one before), as text-generation
    servers do: decoding a window on its own would lose a leading space some tokenizers attach."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: the token before the unprinted ones
        self._read = 0  # tokens already printed

    def push(self, token: int) -> str:
        self._ids.append(token)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # incomplete character: wait for more bytes
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
