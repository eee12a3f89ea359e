"""``placement.balance_at: dispatch``: prompt records change controller before generation.
The plan by hand and on random costs (deterministic, every record generated once), the
config's limits, and on two gloo ranks with a tiny text policy the balanced steps against
the unbalanced ones: the same update up to summation order, each rank's data cursor its
own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_placement_exchange import _overrides as exchange_overrides
from test_placement_exchange import _run, skewed_setup

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.placement.dispatch_balance import plan_dispatch


def test_plan_by_hand():
    # rank 0 drew records of cost 10 and 8, rank 1 two of cost 1. Karmarkar-Karp, two at
    # a time in cost order: (1, 1) spread 0 and (8, 10) spread 2, merged heaviest with
    # lightest: {10, 1} = 11 and {8, 1} = 9. Each part shares one record with each rank,
    # so the first goes to rank 0 and the second to rank 1
    plan = plan_dispatch([[10.0, 8.0], [1.0, 1.0]])
    assert plan.take == [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]
    assert plan.moved == 2
    assert plan.held == [18.0, 2.0] and plan.planned == [11.0, 9.0]


def test_a_plan_that_balances_nothing_moves_nothing():
    plan = plan_dispatch([[5.0, 1.0], [1.0, 5.0]])
    assert plan.take == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]] and plan.moved == 0
    assert plan_dispatch([[], []]).take == [[], []]


def test_plan_is_deterministic_and_generates_every_record_once():
    rng = random.Random(0)
    for trial in range(50):
        P, n = rng.randint(2, 4), rng.randint(1, 6)
        costs = [[float(rng.randint(1, 60)) for _ in range(n)] for _ in range(P)]
        plan = plan_dispatch(costs)
        assert plan == plan_dispatch([list(c) for c in costs]), trial
        taken = [x for items in plan.take for x in items]
        assert sorted(taken) == [(r, i) for r in range(P) for i in range(n)], trial
        assert [len(items) for items in plan.take] == [n] * P  # equal counts
        assert max(plan.planned) <= max(plan.held) + 1e-9
        assert sum(plan.planned) == pytest.approx(sum(plan.held))
        assert plan.moved == sum(src != r for r, items in enumerate(plan.take) for src, _ in items)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["model.kind=vlm"], "use placement.balance_at=update"),
        (["rollout.over_dispatch_ratio=1.5"], "rollout.over_dispatch_ratio=1"),
        (["placement.merge_rollout=true"], "merge_rollout"),
    ],
)
def test_config_names_what_dispatch_balancing_does_not_support(extra, match):
    on = ["placement.balance=true", "placement.balance_at=dispatch"]
    load_config(None, on)  # text: accepted
    with pytest.raises(ConfigError, match=match):
        load_config(None, on + extra)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return skewed_setup(tmp_path_factory.mktemp("dispatch_balance"))


def _overrides(root: Path, model: Path, balance: bool) -> list[str]:
    """The exchange tests' skewed run (rank 0 draws the long prompts), in one minibatch
    (several would each hold other groups than without balancing), balanced at dispatch."""
    dispatch = ["algorithm.minibatches=1", "placement.balance_at=dispatch"]
    return exchange_overrides(root, model, balance) + dispatch


def test_balanced_dispatch_same_update_and_cursors_unmoved(tmp_path, skewed):
    root, model = skewed
    (plain0, bal0), (plain1, bal1) = _run(
        tmp_path, [_overrides(root, model, False), _overrides(root, model, True)]
    )
    for step in range(2):
        a, b = plain0["rows"][step], bal0["rows"][step]
        assert "balance/dispatch_moved" not in a
        assert b["balance/dispatch_moved"] > 0
        assert b["balance/dispatch_before"] > 1.3  # rank 0 drew the long prompts
        assert b["balance/dispatch_after"] <= 1.10
        assert b["balance/dispatch_cost/rank0"] < b["balance/dispatch_cost_held/rank0"]
        assert b["dist/idle_s"] == pytest.approx(b["dist/idle_s/rank0"] + b["dist/idle_s/rank1"])
        assert a["train/grad_norm"] > 0  # a real update, not a zero gradient
        for k in ("reward/mean", "rollout/tokens", "train/loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        # every record drawn is trained on once, some of them on the other rank
        drawn = plain0["trained"][step] + plain1["trained"][step]
        moved = bal0["trained"][step] + bal1["trained"][step]
        assert sorted(moved) == sorted(drawn) and len(set(drawn)) == 8
        assert bal0["trained"][step] != plain0["trained"][step]
    for p1, p2 in zip(plain0["params"], bal0["params"]):
        # 2 Adam steps at lr 1e-3: within 5% of one step. Adam divides by the gradient's
        # own scale, so a coordinate whose gradient is near zero turns the rounding of
        # another summation order into up to a step (one of 8192 here, by 1.2e-5)
        torch.testing.assert_close(torch.tensor(p1), torch.tensor(p2), atol=5e-5, rtol=0)
    assert bal0["params"] == bal1["params"]  # the ranks hold the same weights
    # records moved for the step only: each rank's cursor is where its own draws left it
    assert bal0["cursor"] == plain0["cursor"] and bal1["cursor"] == plain1["cursor"]
