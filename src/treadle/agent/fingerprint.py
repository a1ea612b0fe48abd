"""A short, stable name for a tokenizer's text <-> ids mapping.

A trainer that tokenizes on its own side (a Hugging Face tokenizer) and the engines
that sample (vLLM, treadle's `HFTokenizer`) must map text to the same ids, or the
trainer's loss lands on tokens the policy never produced. `tokenizer_fingerprint`
names what decides that mapping, so the two sides can compare one string::

    tokenizer_fingerprint("/ckpt")                                # the engines' files
    tokenizer_fingerprint(AutoTokenizer.from_pretrained("/ckpt"))  # what the trainer got

The two differ when transformers rebuilt the pipeline on load (it does for Qwen2
checkpoints unless told not to; see `treadle.train.model.tokenizer_config`).

What is hashed: the `tokenizer.json` sections ``normalizer``, ``pre_tokenizer``,
``model`` (type, options, vocabulary, merges in priority order), ``added_tokens``
(content, id and matching flags) and ``decoder``, as canonical JSON. Left out, as
they do not change ``encode(text, add_special_tokens=False)`` nor ``decode``:
``version``; ``truncation`` and ``padding`` (per-call settings, which transformers
resets on load); ``post_processor`` (special tokens added around a sequence, which
treadle never asks for and transformers rewrites from its own add_bos/add_eos).

Stability: the same file gives the same fingerprint on any machine, whatever
`tokenizers` is installed (the file is read as JSON, not re-serialized). For a
loaded object the installed `tokenizers` serializes it; a release that adds a field
can change the fingerprint of an unchanged tokenizer. That errs on the safe side: a
false mismatch asks for a check, a false match cannot happen short of a SHA-256
collision.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

PREFIX = "tok-"
HEX_DIGITS = 16  # 64 bits: collisions among the tokenizers of one deployment are moot
SECTIONS = ("normalizer", "pre_tokenizer", "model", "added_tokens", "decoder")


def tokenizer_fingerprint(source: object) -> str:
    """``"tok-"`` + the first 16 hex digits of SHA-256 over the encoding-deciding
    sections of `source`'s `tokenizer.json` (see the module docstring).

    `source` is a directory holding `tokenizer.json`, the file itself (str or
    path-like), a `tokenizers.Tokenizer`, a transformers fast tokenizer (anything
    with `backend_tokenizer`) or a treadle `HFTokenizer`. Equal fingerprints mean
    equal encodings; FileNotFoundError if a path has no `tokenizer.json`, TypeError
    for any other kind of object, ValueError if the JSON is not a tokenizer."""
    return PREFIX + _digest(canonical_tokenizer(tokenizer_json(source)))[:HEX_DIGITS]


def section_digests(source: object) -> dict[str, str]:
    """Each hashed section's own digest (16 hex digits), to say *what* differs when
    two fingerprints do: compare the two dicts key by key."""
    canonical = canonical_tokenizer(tokenizer_json(source))
    return {name: _digest(canonical[name])[:HEX_DIGITS] for name in SECTIONS}


def tokenizer_json(source: object) -> dict[str, Any]:
    """`source`'s `tokenizer.json` content, parsed (the kinds `tokenizer_fingerprint`
    takes)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        text = file.read_text(encoding="utf-8")
    else:
        text = _serialized(source)
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a tokenizer.json holds a JSON object")
    return data


def canonical_tokenizer(data: dict[str, Any]) -> dict[str, Any]:
    """The hashed sections of a parsed `tokenizer.json`, with the spellings that mean
    the same thing made equal: merges as pairs (tokenizers < 0.20 wrote ``"a b"``
    strings) and added tokens in id order."""
    model = data.get("model")
    if not isinstance(model, dict) or "type" not in model:
        raise ValueError("not a tokenizer.json: no model section with a type")
    model = dict(model)
    if isinstance(model.get("merges"), list):
        model["merges"] = [_merge_pair(m) for m in model["merges"]]
    added = sorted(data.get("added_tokens") or [], key=lambda t: int(t.get("id", -1)))
    return {"normalizer": data.get("normalizer"), "pre_tokenizer": data.get("pre_tokenizer"),
            "model": model, "added_tokens": added, "decoder": data.get("decoder")}


def _serialized(source: object) -> str:
    # A transformers tokenizer wraps the Rust tokenizer it encodes with; treadle's
    # HFTokenizer keeps its own in `_tok` (chat.py has no public accessor for it).
    from treadle.agent.tokenizer import HFTokenizer

    inner: Any = source
    if isinstance(source, HFTokenizer):
        inner = source._tok
    elif hasattr(source, "backend_tokenizer"):
        inner = source.backend_tokenizer
    to_str = getattr(inner, "to_str", None)
    if not callable(to_str):
        raise TypeError(f"cannot fingerprint a {type(source).__name__}: pass a tokenizer "
                        "directory, a tokenizer.json path, a tokenizers.Tokenizer, a "
                        "transformers fast tokenizer or an HFTokenizer")
    text = to_str()
    if not isinstance(text, str):
        raise TypeError(f"{type(inner).__name__}.to_str() returned {type(text).__name__}")
    return text


def _merge_pair(merge: Any) -> Any:
    # Byte-level tokens never hold a literal space, so the old "a b" form splits
    # unambiguously; anything else is kept as written (and so hashes as written).
    if isinstance(merge, str):
        parts = merge.split(" ")
        return parts if len(parts) == 2 else merge
    return list(merge) if isinstance(merge, (list, tuple)) else merge


def _digest(value: Any) -> str:
    # sort_keys orders the vocabulary (a token -> id map) and every option map;
    # ensure_ascii=False keeps the hash independent of how a file escaped unicode.
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
