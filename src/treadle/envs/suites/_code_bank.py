"""The bundled function-writing problems of the `code` suite (original, 20 of them).

Each problem: the entry point, a statement, a reference solution (source text),
hand-picked argument lists (edge cases first), and a generator of random argument
lists. Expected outputs are computed from the reference solution on the host when
tasks are built, so the stored tests and the reference cannot disagree.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Args = list[Any]


@dataclass(frozen=True, slots=True)
class Problem:
    entry_point: str
    statement: str
    solution: str
    fixed: list[Args]
    random_args: Callable[[random.Random], Args]


def _word(rng: random.Random, alphabet: str = "abc", lo: int = 0, hi: int = 12) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n_lo: int = 0,
          n_hi: int = 12) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


PROBLEMS: list[Problem] = [
    Problem("rle_encode",
            "Run-length encode a string: each maximal run of one character becomes the "
            "character followed by the run length. rle_encode('aaabcc') == 'a3b1c2'; the empty "
            "string encodes to ''.",
            "def rle_encode(s):\n    out = []\n    i = 0\n    while i < len(s):\n"
            "        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
            "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
            [["aaabcc"], [""], ["z"], ["abab"], ["xxxxxxxxxxxx"]],
            lambda r: [_word(r, "ab", 0, 15)]),
    Problem("is_balanced",
            "Return True if every bracket in the string ((), [], {}) is closed by the matching "
            "bracket in the right order; other characters are ignored.",
            "def is_balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
            "    for ch in s:\n        if ch in '([{':\n            stack.append(ch)\n"
            "        elif ch in pairs:\n            if not stack or stack.pop() != pairs[ch]:\n"
            "                return False\n    return not stack\n",
            [["([]{})"], ["([)]"], [""], ["((("], ["a(b)c]"], ["}{"]],
            lambda r: [_word(r, "()[]{}x", 0, 10)]),
    Problem("roman_to_int",
            "Convert a Roman numeral (I, V, X, L, C, D, M with subtractive pairs such as IV, "
            "XC, CM) between 1 and 3999 to an integer.",
            "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, "
            "'D': 500, 'M': 1000}\n    total = 0\n    for i, ch in enumerate(s):\n"
            "        if i + 1 < len(s) and v[ch] < v[s[i + 1]]:\n            total -= v[ch]\n"
            "        else:\n            total += v[ch]\n    return total\n",
            [["III"], ["IV"], ["MCMXCIV"], ["MMMCMXCIX"], ["XLII"]],
            lambda r: [r.choice(["LVIII", "CDXLIV", "MMXXIV", "DCCCXC", "IX", "CCCLXV"])]),
    Problem("int_to_roman",
            "Convert an integer between 1 and 3999 to a Roman numeral in standard form "
            "(int_to_roman(1994) == 'MCMXCIV').",
            "def int_to_roman(n):\n    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), "
            "(400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), "
            "(5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for value, sym in table:\n"
            "        while n >= value:\n            out += sym\n            n -= value\n"
            "    return out\n",
            [[1], [4], [1994], [3999], [40]],
            lambda r: [r.randint(1, 3999)]),
    Problem("merge_intervals",
            "Given a list of [start, end] integer intervals (start <= end, any order), merge "
            "the overlapping or touching ones ([1,3] and [3,5] merge) and return the merged "
            "intervals sorted by start, as a list of [start, end] lists.",
            "def merge_intervals(intervals):\n    out = []\n"
            "    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n"
            "            out[-1][1] = max(out[-1][1], e)\n        else:\n"
            "            out.append([s, e])\n    return out\n",
            [[[[1, 3], [2, 6], [8, 10]]], [[]], [[[5, 5]]], [[[1, 3], [3, 5]]],
             [[[6, 9], [1, 2], [2, 4]]]],
            lambda r: [[sorted((r.randint(0, 30), r.randint(0, 30)))
                        for _ in range(r.randint(0, 7))]]),
    Problem("common_prefix",
            "Return the longest common prefix of a list of strings ('' for an empty list).",
            "def common_prefix(words):\n    if not words:\n        return ''\n"
            "    prefix = words[0]\n    for w in words[1:]:\n"
            "        while not w.startswith(prefix):\n            prefix = prefix[:-1]\n"
            "    return prefix\n",
            [[["flower", "flow", "flight"]], [[]], [["same", "same"]], [["a", "b"]],
             [["solo"]]],
            lambda r: [["ab" + _word(r, "ab", 0, 4) for _ in range(r.randint(1, 5))]]),
    Problem("flatten",
            "Flatten an arbitrarily nested list of integers into a flat list, keeping the "
            "left-to-right order.",
            "def flatten(items):\n    out = []\n    for x in items:\n"
            "        if isinstance(x, list):\n            out.extend(flatten(x))\n"
            "        else:\n            out.append(x)\n    return out\n",
            [[[1, [2, [3, 4]], 5]], [[]], [[[[[]]]]], [[[1], [2], [[3]]]]],
            lambda r: [[r.randint(0, 9), [r.randint(0, 9), [r.randint(0, 9)]], []]]),
    Problem("rotate_clockwise",
            "Rotate a rectangular matrix (a list of equal-length rows) 90 degrees clockwise "
            "and return the new matrix.",
            "def rotate_clockwise(m):\n    return [list(row) for row in zip(*m[::-1])]\n",
            [[[[1, 2], [3, 4]]], [[[1, 2, 3]]], [[[1], [2], [3]]], [[[5]]]],
            lambda r: [[[r.randint(0, 9) for _ in range(3)] for _ in range(r.randint(1, 4))]]),
    Problem("word_counts",
            "Count the words of a text, case-insensitively, where a word is a maximal run of "
            "ASCII letters. Return a dict from lower-case word to count.",
            "import re\n\ndef word_counts(text):\n    counts = {}\n"
            "    for w in re.findall('[a-zA-Z]+', text):\n        w = w.lower()\n"
            "        counts[w] = counts.get(w, 0) + 1\n    return counts\n",
            [["The cat and the hat."], [""], ["a-b a_b A"], ["123 go GO go!"]],
            lambda r: [" ".join(_word(r, "abAB", 1, 3) for _ in range(r.randint(0, 8)))]),
    Problem("two_sum",
            "Return the indices [i, j] (i < j) of the first pair, in order of j and then i, "
            "whose values add up to target; return [] if there is none.",
            "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
            "        if target - x in seen:\n            return [seen[target - x], j]\n"
            "        seen.setdefault(x, j)\n    return []\n",
            [[[2, 7, 11, 15], 9], [[3, 3], 6], [[1, 2], 7], [[], 0], [[0, 4, 3, 0], 0]],
            lambda r: [_ints(r, -5, 5, 0, 8), r.randint(-6, 6)]),
    Problem("caesar",
            "Shift every ASCII letter of the text by k places in the alphabet (k may be "
            "negative or larger than 26), keeping case; other characters are unchanged.",
            "def caesar(text, k):\n    out = []\n    for ch in text:\n"
            "        if 'a' <= ch <= 'z':\n"
            "            out.append(chr((ord(ch) - 97 + k) % 26 + 97))\n"
            "        elif 'A' <= ch <= 'Z':\n"
            "            out.append(chr((ord(ch) - 65 + k) % 26 + 65))\n"
            "        else:\n            out.append(ch)\n    return ''.join(out)\n",
            [["abc", 1], ["xyz", 3], ["Hello, World!", -1], ["", 5], ["Zz", 52]],
            lambda r: [_word(r, string.ascii_letters + " .", 0, 12), r.randint(-60, 60)]),
    Problem("digital_root",
            "Repeatedly sum the decimal digits of a non-negative integer until one digit "
            "remains, and return it.",
            "def digital_root(n):\n    while n >= 10:\n        n = sum(int(d) for d in str(n))\n"
            "    return n\n",
            [[0], [9], [38], [999999999999], [10]],
            lambda r: [r.randint(0, 10**12)]),
    Problem("count_primes",
            "Return how many prime numbers are strictly less than n (n >= 0).",
            "def count_primes(n):\n    if n < 3:\n        return 0\n    sieve = [True] * n\n"
            "    sieve[0] = sieve[1] = False\n    for i in range(2, int(n ** 0.5) + 1):\n"
            "        if sieve[i]:\n"
            "            sieve[i * i::i] = [False] * len(range(i * i, n, i))\n"
            "    return sum(sieve)\n",
            [[0], [2], [3], [10], [100000]],
            lambda r: [r.randint(0, 5000)]),
    Problem("spiral",
            "Return the elements of a rectangular matrix in clockwise spiral order, starting "
            "at the top-left corner.",
            "def spiral(m):\n    out = []\n    m = [list(r) for r in m]\n    while m:\n"
            "        out += m.pop(0)\n        m = [list(r) for r in zip(*m)][::-1]\n"
            "    return out\n",
            [[[[1, 2, 3], [4, 5, 6], [7, 8, 9]]], [[]], [[[1]]], [[[1, 2], [3, 4], [5, 6]]]],
            lambda r: [[[r.randint(0, 9) for _ in range(3)]
                        for _ in range(r.randint(1, 4))]]),
    Problem("ranges",
            "Summarise a sorted list of distinct integers as ranges: runs of consecutive "
            "numbers become 'a-b', single numbers 'a'. ranges([1, 2, 3, 5, 7, 8]) == "
            "['1-3', '5', '7-8'].",
            "def ranges(nums):\n    out = []\n    i = 0\n    while i < len(nums):\n"
            "        j = i\n        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:\n"
            "            j += 1\n"
            "        out.append(str(nums[i]) if i == j else f'{nums[i]}-{nums[j]}')\n"
            "        i = j + 1\n    return out\n",
            [[[1, 2, 3, 5, 7, 8]], [[]], [[4]], [[-3, -2, -1, 1]]],
            lambda r: [sorted(set(_ints(r, -10, 20, 0, 12)))]),
    Problem("max_subarray",
            "Return the largest sum of a non-empty contiguous sub-list of a non-empty list of "
            "integers.",
            "def max_subarray(nums):\n    best = cur = nums[0]\n    for x in nums[1:]:\n"
            "        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
            [[[-2, 1, -3, 4, -1, 2, 1, -5, 4]], [[-3]], [[-5, -2, -9]], [[1, 2, 3]]],
            lambda r: [_ints(r, -10, 10, 1, 15)]),
    Problem("pascal_row",
            "Return row n (n >= 0) of Pascal's triangle as a list; row 0 is [1].",
            "def pascal_row(n):\n    row = [1]\n    for _ in range(n):\n"
            "        row = [a + b for a, b in zip([0] + row, row + [0])]\n    return row\n",
            [[0], [1], [4], [30]],
            lambda r: [r.randint(0, 40)]),
    Problem("snake_case",
            "Convert a camelCase or PascalCase identifier to snake_case: an underscore goes "
            "before each upper-case letter that follows a lower-case letter or a digit, and "
            "the result is lower case. snake_case('parseHTTPResponse2Fast') == "
            "'parse_httpresponse2_fast'.",
            "def snake_case(name):\n    out = []\n    for i, ch in enumerate(name):\n"
            "        if ch.isupper() and i > 0 and (name[i - 1].islower() or "
            "name[i - 1].isdigit()):\n            out.append('_')\n        out.append(ch.lower())\n"
            "    return ''.join(out)\n",
            [["camelCase"], ["PascalCase"], ["parseHTTPResponse2Fast"], [""], ["x"]],
            lambda r: [_word(r, "abAB1", 0, 10)]),
    Problem("median",
            "Return the median of a non-empty list of numbers as a float (the mean of the two "
            "middle values for an even length).",
            "def median(nums):\n    s = sorted(nums)\n    n = len(s)\n"
            "    mid = n // 2\n    return float(s[mid]) if n % 2 else (s[mid - 1] + s[mid]) / 2\n",
            [[[3, 1, 2]], [[4, 1, 3, 2]], [[7]], [[-1, -1, 5, 5]]],
            lambda r: [_ints(r, -50, 50, 1, 9)]),
    Problem("edit_distance",
            "Return the Levenshtein distance between two strings (insertions, deletions and "
            "substitutions each cost 1).",
            "def edit_distance(a, b):\n    prev = list(range(len(b) + 1))\n"
            "    for i, ca in enumerate(a, 1):\n        cur = [i]\n"
            "        for j, cb in enumerate(b, 1):\n"
            "            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))\n"
            "        prev = cur\n    return prev[-1]\n",
            [["kitten", "sitting"], ["", "abc"], ["same", "same"], ["abc", ""]],
            lambda r: [_word(r, "abc", 0, 7), _word(r, "abc", 0, 7)]),
]
