"""placement.merge_rollout: in partial steps the first controller generates every
controller's prompt groups in one batch and streams them to the judge; each controller
gets back exactly the samples and rewards it would have generated itself. Checked here:
the settings it cannot run with fail before start, naming why; and two controllers with
a judge give the same samples and rewards, rank by rank, merged or not, with the judge
released for training (placement.partial_release_judge) or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.placement.config import check_placement


def _judged() -> list[str]:
    from test_placement_modes import NO, YES

    # an untrained judge ranks no "Yes" or "No" in its top 20: the mass of one half of
    # the characters against the other's (as in test_placement_modes)
    return [
        "placement.mode=partial",
        "reward.functions=[{name: genrm, kwargs: {template: yes_no_correct, "
        f"yes_tokens: {json.dumps(list(YES))}, no_tokens: {json.dumps(list(NO))}}}}}, "
        "{name: numeric_match, weight: 0.5}]",
    ]


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["placement.mode=colocate"], "placement.mode=colocate has none"),
        (["placement.mode=shared"], "placement.mode=shared has none"),
        (["model.kind=vlm"], "model.kind=vlm records hold media"),
        (["train.backend=fsdp2"], "train.backend=fsdp2 shards the policy"),
        (["rollout.backend=vllm"], "rollout.backend=vllm serves its own batches"),
        (["rollout.over_dispatch_ratio=1.5"], "over-dispatch cuts"),
    ],
)
def test_settings_it_cannot_run_with_fail_before_start(overrides, why):
    base = ["placement.mode=partial", "placement.merge_rollout=true"]
    with pytest.raises(ConfigError) as e:
        if overrides == ["rollout.backend=vllm"]:  # not installed here: checked directly
            cfg = load_config(None, base)
            vllm = cfg.rollout.model_copy(update={"backend": "vllm"})
            check_placement(cfg.model_copy(update={"rollout": vllm}))
        else:
            load_config(None, base + overrides)
    msg = str(e.value)
    assert "placement.merge_rollout=true cannot run here" in msg and why in msg, msg


def test_partial_and_auto_accept_it():
    for mode in ("partial", "auto"):
        cfg = load_config(None, [f"placement.mode={mode}", "placement.merge_rollout=true"])
        assert cfg.placement.merge_rollout


def _samples(run: Path, rank: int) -> list[dict]:
    rows = [json.loads(x) for x in (run / "rollouts" / f"rank{rank}.jsonl").open()]
    keep = ("step", "prompt_id", "sample", "output", "reward", "length", "truncated")
    return [{k: r.get(k) for k in keep} for r in rows]


def test_two_controllers_get_their_own_samples_and_rewards_merged_or_not(tmp_path):
    from test_cli import ROOT, TINY, mmyatt
    from test_placement_modes import CORPUS

    from mmyatt.models.builtin.tiny import build_tiny_text_model

    judge = build_tiny_text_model(tmp_path / "judge", size="qwen2-0.1m", corpus=CORPUS, seed=1)
    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    args = [
        *TINY,
        *_judged(),
        f"reward.judge.model={judge}",
        "distributed.nproc=2",
        "trainer.steps=3",
        "sampling.max_new_tokens=6",
        "sampling.stop=[e, t, s, o, a]",  # varied lengths: samples finish at different steps
    ]
    runs = {}
    merge, release = "placement.merge_rollout=true", "placement.partial_release_judge=true"
    arms = {"each": [], "merged": [merge], "each_release": [release]}
    arms["merged_release"] = [merge, release]  # the GPU layout of docs/placement.md, on cores
    for name, extra in arms.items():
        runs[name] = tmp_path / name
        mmyatt(tmp_path, "train", cfg, *args, *extra, "--run-dir", str(runs[name]))
    for rank in (0, 1):
        for other in ("merged", "each_release", "merged_release"):
            a, b = _samples(runs["each"], rank), _samples(runs[other], rank)
            assert len(a) == len(b) == 3 * 4 // 2 * 4  # 3 steps x 2 groups x 4 samples
            for x, y in zip(a, b):
                # the judge's answers move in the last bits with how its server batches them
                assert abs(x.pop("reward") - y.pop("reward")) < 1e-5, (other, rank, x, y)
                assert x == y, (other, rank)
    for name in ("each_release", "merged_release"):  # asleep through each step's training
        rows = [json.loads(x) for x in (runs[name] / "metrics.jsonl").open()]
        steps = [r for r in rows if "placement/mode" in r]
        assert all(r["timing/judge_release_s"] > 0 for r in steps), name
        assert [r["placement/judge_reload_s"] > 0 for r in steps] == [False, True, True], name
    assert {r["output"] for r in _samples(runs["merged"], 1)} != {""}
    assert len({r["reward"] for r in _samples(runs["merged"], 1)}) > 1  # not all alike
    for name, merged in (("each", 0.0), ("merged", 1.0)):
        rows = [json.loads(x) for x in (runs[name] / "metrics.jsonl").open()]
        steps = [r for r in rows if "placement/mode" in r]
        assert [r["placement/mode"] for r in steps] == ["partial"] * 3
        assert [r["placement/rollout_merged"] for r in steps] == [merged] * 3
