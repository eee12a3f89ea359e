"""Balanced controllers in the step (placement.balance): on a skewed workload over two
gloo ranks with a tiny text policy, the exchange brings max/mean rank work under 1.10
and the update equals the one without balancing (the all-reduce sums the same samples);
joining text contexts of different widths; which rank each part goes to."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mmyatt.config.schema import load_config
from mmyatt.datasets.synthetic import write_jsonl
from mmyatt.distributed import free_port, init_from_env, shutdown
from mmyatt.placement.exchange import assign_parts, choose_parts, concat_padded, group_costs
from mmyatt.rollout import Rollout
from mmyatt.step import builders
from mmyatt.step.builders import build_controller


def test_assign_parts_moves_few_samples():
    # items 0-3 on rank 0, 4-7 on rank 1; part A holds three of rank 1's: A -> rank 1
    owner = [0, 0, 0, 0, 1, 1, 1, 1]
    parts = [[0, 5, 6, 7], [1, 2, 3, 4]]
    assert assign_parts(parts, owner, 2) == [1, 0]


def test_a_partition_no_lighter_than_the_ranks_holdings_moves_nothing():
    # 4 equal groups, 2 per rank: any pairing ties, so each rank keeps its own
    assert choose_parts([5.0, 5.0, 5.0, 5.0], [0, 0, 1, 1], 2) == [[0, 1], [2, 3]]
    # rank 0 holds both heavy groups (18 against 2): they split, one heavy per rank
    parts = choose_parts([9.0, 9.0, 1.0, 1.0], [0, 0, 1, 1], 2)
    assert sorted(sorted(p)[0] for p in parts) == [0, 1] and all(len(p) == 2 for p in parts)
    # ranks holding unequal counts are never kept: every rank must get as many groups
    assert sorted(len(p) for p in choose_parts([1.0, 1.0, 1.0, 5.0], [0, 0, 0, 1], 2)) == [2, 2]


def _text_rollout(prompt_width: int, n: int, fill: int) -> Rollout:
    ids = torch.full((n, prompt_width + 2), fill)
    attn = torch.ones(n, prompt_width + 2, dtype=torch.long)
    return Rollout(
        [f"p{fill}"] * n,
        torch.full((n, 2), fill),
        torch.zeros(n, 2),
        torch.ones(n, 2),
        {"input_ids": ids, "attention_mask": attn, "temperature": 1.0},
        ["x"] * n,
        [{}] * n,
    )


def test_concat_padded_left_pads_the_text_context():
    r = concat_padded([_text_rollout(3, 1, 7), _text_rollout(1, 2, 9)])
    assert r.context["input_ids"].tolist() == [[7] * 5, [0, 0, 9, 9, 9], [0, 0, 9, 9, 9]]
    assert r.context["attention_mask"][1].tolist() == [0, 0, 1, 1, 1]
    assert r.actions.shape == (3, 2) and r.outputs == [None] * 3


def test_group_costs_count_the_prompt_once():
    # two groups: p7 (prompt 3, 2 samples x 2 actions) and p9 (prompt 1, 1 sample)
    r = concat_padded([_text_rollout(3, 2, 7), _text_rollout(1, 1, 9)])
    assert r.prompt_ids == ["p7", "p7", "p9"]
    assert group_costs(r, "text") == [3 + 2 * 2, 1 + 2]
    r.mask[0, 1] = 0  # a completion one action shorter
    assert group_costs(r, "text") == [3 + 3, 1 + 2]
    assert group_costs(r, "flow") == [3, 2]  # trained transitions only


CORPUS = ["Question: 12+30= Answer: 42 Is the answer correct? Answer Yes or No. Yes"] * 40


def skewed_setup(root: Path) -> tuple[Path, Path]:
    """(``root``, a tiny text policy under it) and ``root/m.jsonl``: 16 records, the even
    ones long prompts, the odd ones short."""
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    model = build_tiny_text_model(root / "policy", size="qwen2-0.1m", corpus=CORPUS, seed=0)
    # skewed: rank 0 owns the even records (long prompts), rank 1 the odd ones (short)
    recs = []
    for i in range(16):
        n = 12 + i if i % 2 == 0 else 1
        recs.append({"prompt": " + ".join(["1"] * n) + " =", "answer": str(n)})
    write_jsonl(root / "m.jsonl", recs)
    return root, model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return skewed_setup(tmp_path_factory.mktemp("exchange"))


def length_reward(completion: str, record: dict) -> float:
    """Varies with the sampled completion, so advantages and gradients are not zero
    (the numbers the tiny policy writes never match)."""
    return len(completion) / 10.0


def _overrides(root: Path, model: Path, balance: bool) -> list[str]:
    return [
        "model.kind=text",
        f"model.path={model}",
        f"data.train={root / 'm.jsonl'}",
        f"data.eval={root / 'm.jsonl'}",
        "data.shuffle=false",
        "data.prompts_per_step=8",
        "sampling.group_size=4",
        "sampling.max_new_tokens=4",
        "model.max_prompt_tokens=256",
        "algorithm.minibatches=2",
        "optim.lr=0.001",
        "reward.functions=[{name: 'test_placement_exchange:length_reward'}]",
        f"placement.balance={str(balance).lower()}",
        "placement.balance_when=always",  # every step, by token counts
    ]


def _rank(rank: int, world: int, port: int, tmp: str, runs, out: str, steps: int = 2):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp}/store-{port}", rank=rank, world_size=world
    )
    dist = init_from_env("gloo", device="cpu")
    try:
        result = []
        for i, overrides in enumerate(runs):  # one after the other in the same group
            cfg = load_config(None, overrides)
            ctl = build_controller(
                cfg,
                Path(tmp) / f"run{i}-{rank}",
                dist,
                policy=builders.build_policy(cfg.model),
                reward=builders.build_reward(cfg.reward),
                shard=builders.build_shard(cfg, rank, world),
                eval_records=[],
            )
            rows, trained = [], []  # trained: the records of each step's samples on this rank
            for _ in range(steps):
                rows.append(ctl.step())
                trained.append(sorted({rec["_index"] for rec in ctl.last_rollout.records}))
            result.append(
                {
                    "rows": rows,
                    "trained": trained,
                    "cursor": ctl.local_state()["cursor"],
                    "params": [p.detach().tolist() for p in ctl.params],
                }
            )
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        shutdown()
    os._exit(0)


def _run(tmp: Path, runs, steps: int = 2) -> list[list[dict]]:
    out = tmp / "out"
    out.mkdir()
    args = (2, free_port(), str(tmp), runs, str(out), steps)
    mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_balanced_step_same_update_and_within_ten_percent(tmp_path, setup):
    root, model = setup
    (plain0, bal0), (plain1, bal1) = _run(
        tmp_path, [_overrides(root, model, False), _overrides(root, model, True)]
    )
    plain, bal = [plain0, plain1], [bal0, bal1]
    for step in range(2):
        a, b = plain[0]["rows"][step], bal[0]["rows"][step]
        assert b["placement/balance_before"] > 1.3  # rank 0 holds the long prompts
        assert b["placement/balance_after"] <= 1.10
        assert b["placement/balance_moved"] > 0
        assert "placement/balance_before" not in a
        assert a["train/grad_norm"] > 0  # a real update, not a zero gradient
        for k in ("reward/mean", "train/loss", "train/grad_norm", "train/optimizer_steps"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    for p1, p2 in zip(plain[0]["params"], bal[0]["params"]):
        # 2 steps x 2 minibatches of Adam at lr 1e-3: within 1% of one Adam step
        torch.testing.assert_close(torch.tensor(p1), torch.tensor(p2), atol=1e-5, rtol=0)
    assert bal[0]["params"] == bal[1]["params"]  # the ranks hold the same weights


def test_micro_batches_same_update_with_and_without_balancing(tmp_path, setup):
    """algorithm.micro_batch_tokens cuts each rank's minibatch into micro-batches of
    similar width and accumulates gradients: the update is the one-pass update, with a
    reference KL and recomputed old log-probs (the no-grad passes) too."""
    root, model = setup
    extra = ["algorithm.kl_coef=0.05", "algorithm.recompute_old_logprobs=true"]
    runs = [
        _overrides(root, model, False) + extra,
        _overrides(root, model, False) + extra + ["algorithm.micro_batch_tokens=48"],
        _overrides(root, model, True) + extra + ["algorithm.micro_batch_tokens=48"],
    ]
    (one0, micro0, both0), (one1, micro1, both1) = _run(tmp_path, runs)
    for step in range(2):
        a = one0["rows"][step]
        assert "train/micro_batches" not in a
        assert a["train/grad_norm"] > 0 and a["train/kl"] > 0 or step == 0
        for b in (micro0["rows"][step], both0["rows"][step]):
            assert b["train/micro_batches"] > 2  # more than one per rank and minibatch
            for k in ("reward/mean", "train/loss", "train/grad_norm", "train/kl"):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    for run in (micro0, both0):
        for p1, p2 in zip(one0["params"], run["params"]):
            torch.testing.assert_close(torch.tensor(p1), torch.tensor(p2), atol=1e-5, rtol=0)
    assert micro0["params"] == micro1["params"] and both0["params"] == both1["params"]


def test_balancing_when_it_pays_leaves_the_update_as_it_was(tmp_path, setup):
    """balance_when: pays (the default): the first step measures, the model is fitted and
    plans the third; whatever it decides (moves, length buckets), the update is the one
    without balancing, and every step logs the decision and each rank's idle time."""
    root, model = setup
    pays = [o for o in _overrides(root, model, True) if not o.startswith("placement.balance_when")]
    pays += ["placement.balance_when=pays", "placement.balance_fit_steps=1"]
    (plain0, bal0), (_, bal1) = _run(tmp_path, [_overrides(root, model, False), pays], steps=3)
    for step in range(3):
        a, b = plain0["rows"][step], bal0["rows"][step]
        assert b["balance/applied"] in (0.0, 1.0)
        assert a["dist/idle_s/rank0"] >= 0 and a["dist/idle_s/rank1"] >= 0  # balancing off too
        assert b["dist/idle_s"] == pytest.approx(b["dist/idle_s/rank0"] + b["dist/idle_s/rank1"])
        for k in ("reward/mean", "train/loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert bal0["rows"][0]["balance/applied"] == 0.0  # measuring
    last = bal0["rows"][2]  # planned by a fitted model: its prediction against the passes
    assert last["balance/predicted_s"] > 0 and last["balance/measured_s"] > 0
    assert last["balance/model_error"] == pytest.approx(
        max(
            abs(last[f"balance/predicted_s/rank{r}"] - last[f"balance/measured_s/rank{r}"])
            / last[f"balance/measured_s/rank{r}"]
            for r in range(2)
        )
    )
    for p1, p2 in zip(plain0["params"], bal0["params"]):
        torch.testing.assert_close(torch.tensor(p1), torch.tensor(p2), atol=1e-5, rtol=0)
    assert bal0["params"] == bal1["params"]
