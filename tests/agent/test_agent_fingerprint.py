"""`tokenizer_fingerprint`: equal for the same tokenizer however it is saved or
loaded, different when anything that changes the encoding does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import build_tokenizer

from treadle.agent.fingerprint import section_digests, tokenizer_fingerprint

# A complete tokenizer.json, written out: its fingerprint is pinned below, so that a
# change to what is hashed (or how) shows here before trainers and engines that
# compare fingerprints computed by different treadle versions disagree.
LITERAL: dict[str, Any] = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": False,
                      "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": False},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": None, "end_of_word_suffix": None,
              "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": {"<|endoftext|>": 0, "a": 1, "b": 2, "é": 3, "ab": 4, "abé": 5},
              "merges": [["a", "b"], ["ab", "é"]]},
}
LITERAL_FINGERPRINT = "tok-37874989314100fe"


def _write(path: Path, data: dict[str, Any], **dump: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(data, **dump), encoding="utf-8")
    return path


def test_the_form_is_tok_and_16_hex_digits(tmp_path: Path) -> None:
    found = tokenizer_fingerprint(_write(tmp_path, LITERAL))
    assert re.fullmatch(r"tok-[0-9a-f]{16}", found)


def test_the_literal_tokenizer_has_its_pinned_fingerprint(tmp_path: Path) -> None:
    assert tokenizer_fingerprint(_write(tmp_path, LITERAL)) == LITERAL_FINGERPRINT


def test_the_same_tokenizer_saved_twice_has_one_fingerprint(tmp_path: Path) -> None:
    a, b = build_tokenizer(tmp_path / "a"), build_tokenizer(tmp_path / "b")
    assert tokenizer_fingerprint(tmp_path / "a") == tokenizer_fingerprint(tmp_path / "b")
    # Every way of naming it: the directory (str or Path), the file, the loaded objects.
    from tokenizers import Tokenizer

    want = tokenizer_fingerprint(tmp_path / "a")
    assert tokenizer_fingerprint(str(tmp_path / "a")) == want
    assert tokenizer_fingerprint(tmp_path / "a" / "tokenizer.json") == want
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) == want
    loaded = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert tokenizer_fingerprint(loaded) == want


def test_spellings_that_encode_the_same_hash_the_same(tmp_path: Path) -> None:
    want = tokenizer_fingerprint(_write(tmp_path / "plain", LITERAL))
    variants: list[dict[str, Any]] = []
    old_merges = json.loads(json.dumps(LITERAL))
    old_merges["model"]["merges"] = ["a b", "ab é"]  # tokenizers < 0.20 wrote strings
    variants.append(old_merges)
    settings = json.loads(json.dumps(LITERAL))  # per-call settings and the post-processor
    settings.update(version="2.0", truncation={"max_length": 8, "stride": 0,
                                               "strategy": "LongestFirst", "direction": "Right"},
                    post_processor={"type": "ByteLevel", "add_prefix_space": True,
                                    "trim_offsets": False, "use_regex": True})
    variants.append(settings)
    reordered = dict(reversed(list(LITERAL.items())))  # key order is not content
    reordered["model"] = dict(reversed(list(LITERAL["model"].items())))
    variants.append(reordered)
    for i, variant in enumerate(variants):
        assert tokenizer_fingerprint(_write(tmp_path / f"v{i}", variant)) == want, i
    # Pretty or compact, escaped unicode or not.
    assert tokenizer_fingerprint(_write(tmp_path / "ascii", LITERAL, ensure_ascii=True)) == want
    assert tokenizer_fingerprint(_write(tmp_path / "pretty", LITERAL, indent=2,
                                        ensure_ascii=False)) == want


def test_adding_a_token_changes_it(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "a")
    before = tokenizer_fingerprint(tok)
    from tokenizers import Tokenizer

    inner = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    inner.add_special_tokens(["<|extra|>"])
    assert tokenizer_fingerprint(inner) != before
    plain = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    plain.add_tokens(["toolcall"])  # a non-special added token counts too
    assert tokenizer_fingerprint(plain) not in (before, tokenizer_fingerprint(inner))
    ours, theirs = section_digests(tok), section_digests(inner)
    assert [k for k in ours if ours[k] != theirs[k]] == ["added_tokens"]


@pytest.mark.parametrize("change", ["vocab", "merges", "merge_order", "pre_tokenizer",
                                    "normalizer", "decoder", "special_flag", "model_option"])
def test_each_deciding_part_changes_it(tmp_path: Path, change: str) -> None:
    data = json.loads(json.dumps(LITERAL))
    section = {"vocab": "model", "merges": "model", "merge_order": "model",
               "model_option": "model", "special_flag": "added_tokens"}.get(change, change)
    if change == "vocab":
        data["model"]["vocab"]["abé"] = 6
    elif change == "merges":
        data["model"]["merges"].append(["b", "é"])
    elif change == "merge_order":
        data["model"]["merges"].reverse()
    elif change == "pre_tokenizer":
        data["pre_tokenizer"]["use_regex"] = True
    elif change == "normalizer":
        data["normalizer"] = {"type": "NFC"}
    elif change == "decoder":
        data["decoder"] = {"type": "Fuse"}
    elif change == "special_flag":
        data["added_tokens"][0]["special"] = False
    else:
        data["model"]["byte_fallback"] = True
    base, changed = _write(tmp_path / "base", LITERAL), _write(tmp_path / "changed", data)
    assert tokenizer_fingerprint(base) != tokenizer_fingerprint(changed)
    ours, theirs = section_digests(base), section_digests(changed)
    assert [k for k in ours if ours[k] != theirs[k]] == [section]


def test_what_is_not_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        tokenizer_fingerprint(tmp_path)
    with pytest.raises(TypeError, match="cannot fingerprint a int"):
        tokenizer_fingerprint(3)
    with pytest.raises(ValueError, match="no model section"):
        tokenizer_fingerprint(_write(tmp_path / "x", {"added_tokens": []}))
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "tokenizer.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        tokenizer_fingerprint(tmp_path / "y")

