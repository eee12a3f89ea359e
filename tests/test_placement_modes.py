"""Placement modes in the real step: the same seeds give the same samples and rewards in
shared, colocate, partial and auto (a tiny text policy judged by a tiny judge served
over HTTP), colocate really drops and reloads the judge's weights, and a run stopped
and resumed in each mode ends where an uninterrupted one does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.placement import resources as res
from mmyatt.step import builders
from mmyatt.step.builders import build_controller

YES = "abcdefghijklmABCDEFGHIJKLM01234\n +"
NO = "nopqrstuvwxyzNOPQRSTUVWXYZ56789.,?="
CORPUS = ["Question: 12+30= Answer: 42 Is the answer correct? Answer Yes or No. Yes", "No"] * 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    root = tmp_path_factory.mktemp("placement")
    judge = build_tiny_text_model(root / "judge", size="qwen2-0.1m", corpus=CORPUS, seed=1)
    policy = build_tiny_text_model(root / "policy", size="qwen2-0.1m", corpus=CORPUS, seed=0)
    base = load_config(None, ["data.synthetic_train_size=64", "data.synthetic_eval_size=8"])
    train, _, _ = builders.synthetic_task("synthetic:arithmetic", root / "data", base)
    return {"judge": judge, "policy": policy, "train": train}


@pytest.fixture
def restore_affinity():
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    yield
    res.pin_process(cores)
    torch.set_num_threads(threads)


def run_mode(
    tmp: Path, models, url: str, mode: str, steps: int = 3, calls=None, extra=(), metrics=None
) -> list:
    cfg = load_config(
        None,
        [
            "model.kind=text",
            f"model.path={models['policy']}",
            f"data.train={models['train']}",
            f"data.eval={models['train']}",
            "data.prompts_per_step=4",
            "sampling.group_size=4",
            "sampling.max_new_tokens=6",
            # completions of varied lengths: groups finish at different steps, and partial
            # sends each to the judge as it does
            "sampling.stop=[e, t, s, o, a, Q]",
            "optim.lr=0.01",
            # an untrained judge ranks no "Yes" or "No" in its top 20: score the mass of
            # one half of the characters against the other's, a continuous function of
            # the judge's own logits
            "reward.functions=[{name: genrm, kwargs: {template: yes_no_correct, "
            f"yes_tokens: {json.dumps(list(YES))}, no_tokens: {json.dumps(list(NO))}}}}}, "
            "{name: numeric_match, weight: 0.5}]",
            f"reward.judge.model={models['judge']}",
            f"reward.judge.urls=[{url}]",
            f"placement.mode={mode}",
            "placement.profile_steps=1",
            "placement.stream_groups=1",
            # auto: warm-up and profiling in colocate, then partial (its default starts in
            # shared), so its steps run the pinned modes too
            *(["placement.profile_all_modes=true"] if mode == "auto" else []),
            *extra,
        ],
    )
    ctl = build_controller(
        cfg,
        tmp / (mode + ("_" + "_".join(extra) if extra else "")),
        Dist(),
        policy=builders.build_policy(cfg.model),
        reward=builders.build_reward(cfg.reward),
        shard=builders.build_shard(cfg, 0, 1),
        eval_records=[],
    )
    out = []
    for _ in range(steps):
        m = ctl.step()
        r = ctl.last_rollout
        out.append((list(r.outputs), r.rewards.clone(), m.get("placement/mode", "shared")))
        if calls is not None:
            calls.append(m.get("placement/judge_calls"))
        if metrics is not None:
            metrics.append(m)
    return out


def test_same_seeds_same_rewards_in_every_mode(tmp_path, models, restore_affinity):
    from mmyatt.serving.server import JudgeServer

    with JudgeServer(str(models["judge"])).start() as server:
        calls: dict[str, list] = {m: [] for m in MODES}
        runs = {m: run_mode(tmp_path, models, server.url, m, calls=calls[m]) for m in MODES}
        stats = server.stats
    ref = runs["shared"]
    for mode, steps in runs.items():
        for (out_a, rew_a, _), (out_b, rew_b, _) in zip(ref, steps):
            assert out_a == out_b, mode
            torch.testing.assert_close(rew_a, rew_b, rtol=0, atol=1e-5, msg=mode)
    assert [m for *_, m in runs["colocate"]] == ["colocate"] * 3
    assert [m for *_, m in runs["partial"]] == ["partial"] * 3
    # partial sent groups to the judge as they finished, in more than one call per step
    # (so the answers were put back in the rollout's order): 4 groups, one call per step
    # at which some finished, one for those the budget cut
    assert max(calls["partial"]) >= 2, calls
    assert [m for *_, m in runs["auto"]] == ["colocate", "colocate", "partial"]
    # colocate dropped the judge's weights after each judge phase and reloaded them
    assert stats["sleeps"] >= 3 and stats["reloads"] >= 3 and stats["reload_s"] > 0
    assert all(float(rew.std()) > 0 for _, rew, _ in ref), [rew for _, rew, _ in ref]


MODES = ("shared", "colocate", "partial", "auto")


def test_partial_release_judge_sleeps_through_training_with_the_same_rewards(
    tmp_path, models, restore_affinity
):
    """placement.partial_release_judge: after every controller holds its rewards the judge
    drops its weights for training and reloads them when the next partial step starts;
    the samples and rewards are those of plain partial."""
    from mmyatt.serving.server import JudgeServer

    with JudgeServer(str(models["judge"])).start() as server:
        plain = run_mode(tmp_path, models, server.url, "partial")
        before = dict(server.stats)
        rows: list[dict] = []
        flag = ["placement.partial_release_judge=true"]
        released = run_mode(tmp_path, models, server.url, "partial", extra=flag, metrics=rows)
        after = dict(server.stats)
    assert before["sleeps"] == 0 and before["reloads"] == 0  # plain partial keeps them
    for (out_a, rew_a, _), (out_b, rew_b, mode) in zip(plain, released):
        assert out_a == out_b and mode == "partial"
        torch.testing.assert_close(rew_a, rew_b, rtol=0, atol=1e-5)
    # 3 steps: released after each, reloaded at the start of the 2nd and 3rd
    assert after["sleeps"] == 3 and after["reloads"] == 2, after
    assert all(r["timing/judge_release_s"] > 0 for r in rows)
    assert [r["placement/judge_reload_s"] > 0 for r in rows] == [False, True, True]


def test_auto_wakes_a_judge_partial_released_whatever_it_runs_next(
    tmp_path, models, restore_affinity
):
    """Under auto a partial step with partial_release_judge leaves the judge asleep; the
    plan after it (any mode, as measured) must wake it before scoring: every step's
    rewards are shared mode's."""
    from mmyatt.serving.server import JudgeServer

    with JudgeServer(str(models["judge"])).start() as server:
        ref = run_mode(tmp_path, models, server.url, "shared", steps=6)
        flag = ["placement.partial_release_judge=true", "placement.reevaluate_every=1"]
        got = run_mode(tmp_path, models, server.url, "auto", steps=6, extra=flag)
        stats = dict(server.stats)
    for (out_a, rew_a, _), (out_b, rew_b, _) in zip(ref, got):
        assert out_a == out_b
        torch.testing.assert_close(rew_a, rew_b, rtol=0, atol=1e-5)
    modes = [m for *_, m in got]
    assert modes[:3] == ["colocate", "colocate", "partial"], modes  # profile_all_modes
    # colocate reloads in every step (it drops the judge first); any other step reloads
    # when the step before left the judge asleep (colocate, or partial with the release)
    prev = [None, *modes[:-1]]
    expect = sum(m == "colocate" or p in ("colocate", "partial") for m, p in zip(modes, prev))
    assert stats["reloads"] == expect, (modes, stats)


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    skip = ("timing/", "perf/", "throughput/", "placement/", "memory/", "train/minutes")
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)}
        for r in rows
        if "reward/mean" in r
    }


EXTRA = {  # shared mode with over-dispatch (carried prompts in the checkpoint), balancing
    "over_dispatch": ["placement.mode=shared", "rollout.over_dispatch_ratio=1.5"],
    # 4 groups per rank with completions of varied lengths: groups of unequal work, so
    # that balancing moves some (with equal groups, or one or two per rank, no partition
    # is lighter than the ranks' own holdings, and nothing moves; here step 3 moves 8)
    "balance": [
        "placement.mode=shared",
        "placement.balance=true",
        "data.prompts_per_step=8",
        "sampling.group_size=2",
        "sampling.max_new_tokens=8",
        "sampling.stop=[e, t, s, o, a]",
    ],
    # partial with the first controller generating for both
    "merged": ["placement.mode=partial", "placement.merge_rollout=true"],
}


@pytest.mark.slow  # three CLI runs of 2 controllers per mode
@pytest.mark.parametrize("mode", ["partial", "colocate", "auto", *EXTRA])
def test_stop_and_resume_equals_uninterrupted_in_every_mode(tmp_path, mode):
    from safetensors.torch import load_file
    from test_cli import ROOT, TINY
    from test_resume import stop_and_resume

    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    # the rule reward of TINY: a judge's answers move in the last bits with how its
    # server happens to batch requests (in every mode, shared included), a rule's do not
    args = [
        *TINY,
        "distributed.nproc=2",
        "checkpoint.save_every=2",
        *EXTRA.get(mode, [f"placement.mode={mode}"]),
        "placement.profile_steps=1",
    ]
    full, parts, out = stop_and_resume(tmp_path, cfg, *args)
    if mode == "auto":  # its measurements came back with the checkpoint
        assert "[placement] auto resumes with the checkpoint's measurements" in out
    final = Path("checkpoints") / "final" / "model.safetensors"
    wa, wb = load_file(str(full / final)), load_file(str(parts / final))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _rows(full) == _rows(parts) and sorted(_rows(parts)) == [1, 2, 3, 4]
    rows = [json.loads(x) for x in (full / "metrics.jsonl").open()]
    modes = {r.get("placement/mode") for r in rows}
    # auto without a judge: shared
    expect = {"merged": "partial"}.get(mode, "shared" if mode in ("auto", *EXTRA) else mode)
    assert modes - {None} == {expect}
    if mode == "over_dispatch":
        assert any(r.get("rollout/carried_prompts", 0) > 0 for r in rows)
    if mode == "merged":
        assert all(r["placement/rollout_merged"] == 1.0 for r in rows if "placement/mode" in r)
    if mode == "balance":
        assert any(r.get("placement/balance_moved", 0) > 0 for r in rows)
