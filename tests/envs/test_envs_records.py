"""`read_jsonl`: task files are read as text mode would split them, and only regular
files of a bounded size are read at all (a FIFO, a device, a directory, a file over
the limit are refused before a byte is read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from treadle.envs.errors import TaskFormatError
from treadle.envs.records import read_jsonl


def test_lines_end_at_lf_crlf_or_a_lone_cr_and_are_numbered_as_text_mode_does(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\r{"a": 2}\r\n\n{"a": 3}')
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (2, {"a": 2}), (4, {"a": 3})]
    path.write_bytes(b'{"a": 1}\n{nope\n')
    with pytest.raises(TaskFormatError, match=r"t.jsonl:2: not JSON"):
        list(read_jsonl(path))
    path.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(TaskFormatError, match=r":1: not UTF-8"):
        list(read_jsonl(path))


def test_only_regular_files_of_a_bounded_size_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular"),
                        (tmp_path, "not a regular file")):
        with pytest.raises(TaskFormatError, match=words):
            list(read_jsonl(path))  # returns at once: no writer is waited for
    big = tmp_path / "big.jsonl"
    big.write_text('{"a": 1}\n' * 100)
    with pytest.raises(TaskFormatError, match="over the limit of 100"):
        list(read_jsonl(big, max_bytes=100))
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "missing.jsonl"))
