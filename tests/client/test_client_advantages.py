"""GRPO advantages: the formula, and the explicit singleton and zero-variance cases."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treadle.client import group_advantages


def test_matches_the_grpo_formula_with_sample_std() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.25, 0.75]
    groups = ["a", "a", "a", "a", "b", "b"]
    out = group_advantages(rewards, groups)
    std_a = statistics.stdev([1.0, 0.0, 0.0, 1.0])  # n - 1, as torch.std
    assert out[:4] == pytest.approx([0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6),
                                     -0.5 / (std_a + 1e-6), 0.5 / (std_a + 1e-6)], rel=1e-12)
    std_b = statistics.stdev([0.25, 0.75])
    assert out[4:] == pytest.approx([-0.25 / (std_b + 1e-6), 0.25 / (std_b + 1e-6)], rel=1e-12)


def test_mean_centred_only() -> None:
    out = group_advantages([3.0, 1.0, 2.0], ["g"] * 3, normalize_std=False)
    assert out == [1.0, -1.0, 0.0]


def test_singleton_group_gets_zero() -> None:
    assert group_advantages([0.9, 1.0, 0.0], ["lone", "g", "g"], normalize_std=False) == \
        [0.0, 0.5, -0.5]


def test_zero_variance_group_gets_exactly_zero() -> None:
    values = [0.1, 0.1, 0.1]
    naive_mean = math.fsum(values) / 3
    assert values[0] - naive_mean != 0.0  # the residue the explicit case removes
    assert group_advantages(values, ["g"] * 3) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0] * 16, ["g"] * 16, epsilon=0.0) == [0.0] * 16


def test_groups_need_not_be_contiguous() -> None:
    rewards = [1.0, 5.0, 0.0, 7.0, 0.5]
    groups = ["a", "b", "a", "b", "a"]
    out = group_advantages(rewards, groups)
    a = group_advantages([1.0, 0.0, 0.5], ["a"] * 3)
    b = group_advantages([5.0, 7.0], ["b"] * 2)
    assert out == [a[0], b[0], a[1], b[1], a[2]]


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="2 rewards but 1 group"):
        group_advantages([1.0, 2.0], ["g"])
    with pytest.raises(ValueError, match="must be finite"):
        group_advantages([math.nan, 1.0], ["g", "g"])
    with pytest.raises(ValueError, match="epsilon"):
        group_advantages([1.0], ["g"], epsilon=-1.0)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=2, max_size=32),
       st.booleans())
def test_advantages_are_centred_and_scaled(rewards: list[float], normalize: bool) -> None:
    out = group_advantages(rewards, ["g"] * len(rewards), normalize_std=normalize)
    if min(rewards) == max(rewards):
        assert out == [0.0] * len(rewards)
        return
    spread = max(abs(r) for r in rewards) + 1.0
    assert abs(math.fsum(out)) <= 1e-9 * spread * len(rewards)
    if normalize:
        std = statistics.stdev(out)
        raw = statistics.stdev(rewards)
        assert std == pytest.approx(raw / (raw + 1e-6), rel=1e-6, abs=1e-9)
