"""The tokenizer the conversation room needs: text to ids and back, special tokens by name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the conversation room needs of a tokenizer. `encode` maps special-token text
    (``<|im_start|>``) to its single id and adds no BOS/EOS of its own."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int:
        """The id of a special token; KeyError naming it if the vocabulary lacks it."""
        ...


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package; no transformers)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # lazy: an optional dependency

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = _Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def token_id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return int(found)


__all__ = ["HFTokenizer", "Tokenizer"]
