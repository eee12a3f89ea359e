"""Rule rewards and their weighted combination."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import mmyatt.rewards
import mmyatt.rewards.rules as rules
from mmyatt.rewards import (
    REGISTRY,
    RewardError,
    WeightedReward,
    answer_tag_match,
    exact_match,
    format_check,
    numeric_match,
    resolve_reward,
)

ANSWER = {"answer": "46"}


def test_exact_match():
    assert exact_match("46", ANSWER) == 1.0
    assert exact_match("  46\n", {"answer": " 46 "}) == 1.0
    assert exact_match("46.0", ANSWER) == 0.0
    assert exact_match("7", {"label": 7}, key="label") == 1.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("46", "46", 1.0),
        ("The answer is 46, surely.", "46", 1.0),
        ("45 then 46", "46", 0.0),  # only the first number counts
        ("-22", "-22", 1.0),
        ("-22", "22", 0.0),
        ("1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("3.5", 3.5, 1.0),
        ("0.1", "0.1000000001", 1.0),  # within rel_tol
        ("no number", "46", 0.0),
        ("", "0", 0.0),
    ],
)
def test_numeric_match(completion, answer, expected):
    assert numeric_match(completion, {"answer": answer}) == expected


def test_numeric_match_tolerance():
    assert numeric_match("100", {"answer": "101"}) == 0.0
    assert numeric_match("100", {"answer": "101"}, rel_tol=0.05) == 1.0


def test_format_check():
    assert format_check("46", {}) == 1.0
    assert format_check(" -3 \n", {}) == 1.0
    assert format_check("46 apples", {}) == 0.0
    assert format_check("4.6", {}) == 0.0
    assert format_check("yes", {}, pattern=r"yes|no") == 1.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>46</answer>", 1.0),
        ("thinking <answer>12</answer> no wait <answer> 46 </answer>", 1.0),  # last tag
        ("<answer>45</answer>", 0.0),
        ("so \\boxed{46}.", 1.0),
        ("\\boxed{{46}}", 0.0),
        ("46", 0.0),  # untagged
        ("\\boxed{46", 0.0),  # unbalanced
    ],
)
def test_answer_tag_match(completion, expected):
    assert answer_tag_match(completion, ANSWER) == expected


def test_boxed_with_nested_braces():
    assert answer_tag_match("\\boxed{\\frac{1}{2}}", {"answer": "\\frac{1}{2}"}) == 1.0


def test_registry_and_resolve():
    assert set(REGISTRY) == {"exact_match", "numeric_match", "format_check", "answer_tag_match"}
    assert resolve_reward("numeric_match") is numeric_match
    with pytest.raises(ValueError, match="unknown reward 'numeric'.*numeric_match"):
        resolve_reward("numeric")
    with pytest.raises(ValueError, match="cannot load reward 'no_such_module_xyz:f'"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="cannot load reward 'math:nope'"):
        resolve_reward("math:nope")
    with pytest.raises(ValueError, match="not a function"):
        resolve_reward("math:pi")


@pytest.fixture
def user_module(monkeypatch):
    """A user reward module importable as ``user_rewards_for_test``."""
    module = types.ModuleType("user_rewards_for_test")

    def length_bonus(completion: str, record: dict, scale: float = 1.0) -> float:
        return scale * len(completion)

    def boom(completion: str, record: dict) -> float:
        raise KeyError("answer")

    def words(completion: str, record: dict) -> str:
        return "one"

    def nan(completion: str, record: dict) -> float:
        return math.nan if completion == "bad" else 1.0

    module.length_bonus, module.boom, module.words, module.nan = length_bonus, boom, words, nan
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_user_function_by_import_path(user_module):
    assert resolve_reward("user_rewards_for_test:length_bonus") is user_module.length_bonus
    reward = WeightedReward(
        [{"name": "user_rewards_for_test:length_bonus", "weight": 2.0, "kwargs": {"scale": 0.5}}]
    )
    total, parts = reward(["abcd", ""], [{}, {}])
    assert total.tolist() == [4.0, 0.0]
    assert parts["user_rewards_for_test:length_bonus"].tolist() == [2.0, 0.0]


def test_weighting():
    reward = WeightedReward(
        [
            {"name": "numeric_match", "weight": 1.0},
            {"name": "format_check", "weight": 0.25},
            {"name": "format_check", "weight": -1.0, "kwargs": {"pattern": "x"}},
            {"name": "exact_match"},  # weight defaults to 1.0
        ]
    )
    outputs = ["46", "46 is it", "x", "45"]
    total, parts = reward(outputs, [ANSWER] * 4)
    assert reward.names == ["numeric_match", "format_check", "format_check#2", "exact_match"]
    assert parts["numeric_match"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert parts["format_check"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert parts["format_check#2"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert parts["exact_match"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert total.dtype == torch.float32 and total.shape == (4,)
    assert total.tolist() == [2.25, 1.0, -1.0, 0.25]


def test_bad_specs():
    with pytest.raises(ValueError, match=r"unknown keys \['kwarg', 'w'\]"):
        WeightedReward([{"name": "exact_match", "w": 1, "kwarg": {}}])
    with pytest.raises(ValueError, match="no 'name'"):
        WeightedReward([{"weight": 1.0}])
    with pytest.raises(ValueError, match="unknown reward"):
        WeightedReward([{"name": "exactmatch"}])
    with pytest.raises(ValueError, match="bad kwargs"):
        WeightedReward([{"name": "exact_match", "kwargs": {"tolerance": 1}}])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        WeightedReward([{"name": "exact_match", "weight": "1"}])
    with pytest.raises(ValueError, match="at least one"):
        WeightedReward([])


def test_reward_error_names_function_sample_source_and_completion(user_module):
    reward = WeightedReward([{"name": "exact_match"}, {"name": "user_rewards_for_test:boom"}])
    long_completion = "y" * 200
    records = [{"answer": "1"}, {"answer": "1", "_source": "data/train.jsonl:17"}]
    with pytest.raises(RewardError) as info:
        reward(["1", long_completion], records)
    message = str(info.value)
    assert "'user_rewards_for_test:boom'" in message
    assert "sample 0" in message  # boom fails on the first sample it sees
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError) as info:
        reward([long_completion], [records[1]])
    message = str(info.value)
    assert "sample 0" in message and "data/train.jsonl:17" in message
    assert repr("y" * 77 + "...") in message and "y" * 78 not in message
    assert "KeyError" in message


def test_reward_error_uses_prompt_id_without_source():
    reward = WeightedReward([{"name": "exact_match"}])  # record lacks "answer": KeyError
    with pytest.raises(RewardError, match="sample 1 \\(prompt id 'p-9'\\)"):
        reward(["a", "b"], [{"answer": "a"}, {}], prompt_ids=["p-8", "p-9"])


def test_non_number_is_a_reward_error(user_module):
    reward = WeightedReward([{"name": "user_rewards_for_test:words"}])
    with pytest.raises(RewardError, match="returned str instead of a number on sample 0"):
        reward(["hi"], [{"_source": "a.jsonl:1"}])


def test_nan_is_propagated(user_module):
    reward = WeightedReward(
        [{"name": "user_rewards_for_test:nan", "weight": 2.0}, {"name": "format_check"}]
    )
    total, parts = reward(["bad", "7"], [{}, {}])
    assert math.isnan(parts["user_rewards_for_test:nan"][0]) and math.isnan(total[0])
    assert total[1].item() == 3.0


def test_length_mismatch():
    reward = WeightedReward([{"name": "exact_match"}])
    with pytest.raises(ValueError, match="2 outputs but 1 records"):
        reward(["a", "b"], [ANSWER])


def test_package_exports():
    for name in mmyatt.rewards.__all__:
        assert getattr(mmyatt.rewards, name) is getattr(rules, name)
