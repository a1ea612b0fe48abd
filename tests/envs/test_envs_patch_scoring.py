"""Pure functions: unified-diff parsing and application, answer normalisation, units."""

from __future__ import annotations

from fractions import Fraction

import pytest

from treadle.envs.scoring import (
    answers_match,
    exact_match,
    extract_answer,
    extract_boxed,
    parse_number,
    token_f1,
)
from treadle.envs.tools.patch import PatchError, apply_hunks, parse_unified_diff
from treadle.envs.units import parse_quantity, quantity_matches

SOURCE = "".join(f"line {i}\n" for i in range(1, 21))


def patch_for(body: str, path: str = "f.txt") -> str:
    return f"diff --git a/{path} b/{path}\nindex 1..2 100644\n--- a/{path}\n+++ b/{path}\n{body}"


def test_parse_strips_git_prefixes_and_reads_hunks() -> None:
    [p] = parse_unified_diff(patch_for("@@ -2,3 +2,3 @@\n line 2\n-line 3\n+LINE 3\n line 4\n"))
    assert (p.old_path, p.new_path, p.path) == ("f.txt", "f.txt", "f.txt")
    assert p.hunks[0].old == ["line 2", "line 3", "line 4"]
    assert p.hunks[0].new == ["line 2", "LINE 3", "line 4"]


def test_apply_exact_offset_and_whitespace_fuzz() -> None:
    [p] = parse_unified_diff(patch_for("@@ -2,3 +2,3 @@\n line 2\n-line 3\n+LINE 3\n line 4\n"))
    out, notes = apply_hunks(SOURCE, p.hunks)
    assert out == SOURCE.replace("line 3\n", "LINE 3\n") and notes == []
    # wrong line numbers: found by context, nearest to the hint
    [p] = parse_unified_diff(patch_for("@@ -15,2 +15,2 @@\n line 7\n-line 8\n+eight\n"))
    out, notes = apply_hunks(SOURCE, p.hunks)
    assert "eight\n" in out and "line 8\n" not in out
    assert notes and "applied at line 7" in notes[0]
    # trailing whitespace in the patch's context still matches
    [p] = parse_unified_diff(patch_for("@@ -1,2 +1,2 @@\n line 1   \n-line 2\n+two\n"))
    out, notes = apply_hunks(SOURCE, p.hunks)
    assert out.startswith("line 1\ntwo\nline 3\n") and "whitespace" in notes[0]


def test_wrong_counts_and_lost_blank_context_are_tolerated() -> None:
    source = "a\n\nb\nc\n"
    # the header claims 9 lines; the blank context line has lost its leading space
    [p] = parse_unified_diff(patch_for("@@ -1,9 +1,9 @@\n a\n\n-b\n+B\n c\n"))
    out, _ = apply_hunks(source, p.hunks)
    assert out == "a\n\nB\nc\n"


def test_multiple_hunks_apply_in_order() -> None:
    body = ("@@ -1,2 +1,2 @@\n-line 1\n+first\n line 2\n"
            "@@ -19,2 +19,3 @@\n line 19\n line 20\n+line 21\n")
    [p] = parse_unified_diff(patch_for(body))
    out, _ = apply_hunks(SOURCE, p.hunks)
    assert out.startswith("first\nline 2\n") and out.endswith("line 20\nline 21\n")


def test_no_newline_marker() -> None:
    [p] = parse_unified_diff(patch_for("@@ -1 +1 @@\n-x\n+y\n\\ No newline at end of file\n"))
    assert apply_hunks("x\n", p.hunks)[0] == "y"


def test_creation_and_deletion_headers() -> None:
    patches = parse_unified_diff("--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+x = 1\n"
                                 "--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-y = 2\n")
    assert (patches[0].old_path, patches[0].new_path) == (None, "new.py")
    assert (patches[1].old_path, patches[1].new_path) == ("old.py", None)
    assert apply_hunks("", patches[0].hunks)[0] == "x = 1\n"


@pytest.mark.parametrize("bad", ["", "just words", "@@ -1 +1 @@\n-a\n+b\n",
                                 "--- a/x\n+++ b/x\n@@ nonsense @@\n",
                                 "--- /dev/null\n+++ /dev/null\n"])
def test_malformed_patches_are_refused(bad: str) -> None:
    with pytest.raises(PatchError):
        parse_unified_diff(bad)


def test_a_mismatching_hunk_names_the_expected_lines() -> None:
    [p] = parse_unified_diff(patch_for("@@ -1,2 +1,2 @@\n line 1\n-line two\n+2\n"))
    with pytest.raises(PatchError, match=r"(?s)hunk 1 does not apply.*line two"):
        apply_hunks(SOURCE, p.hunks, "f.txt")


# -- answers ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [
    ("42", Fraction(42)), ("-7", Fraction(-7)), ("−7", Fraction(-7)), ("1,234,567", 1234567),
    ("3/4", Fraction(3, 4)), ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{-3}{8}", Fraction(-3, 8)),
    ("\\frac34", Fraction(3, 4)), ("0.125", Fraction(1, 8)), ("1.5e3", 1500),
    ("2.5 \\times 10^{-2}", Fraction(1, 40)), ("x = 5", 5), ("$12", 12), ("25\\%", 25),
    ("2 1/2", Fraction(5, 2)), ("(3)/(4)", Fraction(3, 4)), ("7.", 7),
])
def test_parse_number(text: str, value: Fraction | int) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "3/0", "x + 1", "1,23", "\\sqrt{2}", "1/2/3"])
def test_parse_number_refuses_non_numbers(text: str) -> None:
    assert parse_number(text) is None


def test_extract_answer() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{7}") == "7"
    assert extract_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_answer("Thinking...\nThe answer is 3.5 m/s. Done") == "3.5 m/s"
    assert extract_answer("Final answer: Velmora") == "Velmora"
    assert extract_answer("  12  ") == "12"


def test_answers_match() -> None:
    assert answers_match("19/12", "19/12") and answers_match("\\frac{19}{12}", "19/12")
    assert answers_match("1.5833333333", "19/12") and not answers_match("1.58", "19/12")
    assert answers_match("1.58", "19/12", rel_tol=0.01)
    assert answers_match("2,000", "2000") and not answers_match("2001", "2000")
    assert answers_match("X + 1", "x+1") and not answers_match("", "")


def test_exact_match_and_f1() -> None:
    assert exact_match("The Zuquex River.", ["Zuquex River"]) == 1.0
    assert exact_match("Zuquex", ["Zuquex River"]) == 0.0
    assert token_f1("Zuquex", ["Zuquex River"]) == pytest.approx(2 / 3)
    assert token_f1("zuquex river", ["Other", "Zuquex River"]) == 1.0
    assert token_f1("nothing shared", ["Zuquex River"]) == 0.0
    assert token_f1("", ["x"]) == 0.0


def test_quantities_and_units() -> None:
    assert parse_quantity("3.1 \\times 10^{4} Pa") == (31000.0, "Pa")
    assert parse_quantity("v = 12.5 m/s.") == (12.5, "m/s")
    assert parse_quantity("about twelve") is None
    assert quantity_matches("0.5 km", 500, "m")[0]
    assert quantity_matches("45 km/h", 12.5, "m/s")[0]
    assert quantity_matches("12.6", 12.5, "m/s")[0]  # no unit: the gold's, within 1%
    assert not quantity_matches("12.8 m/s", 12.5, "m/s")[0]
    ok, why = quantity_matches("12.5 m", 12.5, "m/s")
    assert not ok and "length" in why
    ok, why = quantity_matches("12.5 furlongs", 12.5, "m")
    assert not ok and "unknown unit" in why
    assert quantity_matches("5 k\\Omega", 5000, "ohm")[0]
    assert quantity_matches("250 mA", 0.25, "A")[0]
