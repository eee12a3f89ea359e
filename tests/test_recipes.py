"""Every shipped recipe runs end to end for one step on a shrunken workload, so a
config and the code paths it selects cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import ROOT, mmyatt

SMALL = [
    "trainer.steps=1",
    "trainer.max_minutes=null",
    "trainer.progress=false",
    "trainer.eval_every=0",
    "distributed.nproc=1",
    "data.prompts_per_step=2",
    "sampling.group_size=2",
    "data.eval_prompts=4",
    "data.synthetic_eval_size=8",
]

RECIPES = {
    "flow_grpo_tiny.yaml": [
        "data.synthetic_train_size=16",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_grpo_video_tiny.yaml": [
        "data.synthetic_train_size=16",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_grpo_genrm_tiny.yaml": [  # starts the built-in judge server with the run
        "data.synthetic_train_size=16",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_nft_genrm_tiny.yaml": [  # the demo: NFT, the judge answering two questions
        "data.synthetic_train_size=16",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_nft_pairwise_tiny.yaml": [  # pairwise GenRM: win rates within each group
        "data.synthetic_train_size=16",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_grpo_geneval_tiny.yaml": [  # the tiny GenEval: the judge asks two questions
        "data.synthetic_train_size=16",
        "data.eval_prompts=10",  # every kind among the held-out prompts
        "data.synthetic_eval_size=10",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "flow_nft_geneval_tiny.yaml": [
        "data.synthetic_train_size=16",
        "data.eval_prompts=10",
        "data.synthetic_eval_size=10",
        "sampling.denoise_steps=3",
        "sampling.eval_denoise_steps=3",
    ],
    "vlm_grpo_image_tiny.yaml": [
        "data.synthetic_train_size=32",
        "sft.max_steps=2",
        "sft.eval_every=1",
        "sft.eval_prompts=4",
        "sft.batch_size=4",
    ],
    "vlm_genrm_tiny.yaml": [  # starts the built-in description judge with the run
        "data.synthetic_train_size=16",
        "data.eval_prompts=16",  # images and clips among them
        "sft.max_steps=2",
        "sft.eval_every=1",
        "sft.eval_prompts=4",
        "sft.batch_size=4",
    ],
    "vlm_genrm_score_tiny.yaml": [  # the judge writes a score that is parsed
        "data.synthetic_train_size=16",
        "data.eval_prompts=16",
        "sft.max_steps=2",
        "sft.eval_every=1",
        "sft.eval_prompts=4",
        "sft.batch_size=4",
    ],
    "vlm_grpo_video_tiny.yaml": [
        "data.synthetic_train_size=8",
        "sft.max_steps=2",
        "sft.eval_every=1",
        "sft.eval_prompts=4",
        "sft.batch_size=4",
    ],
}


def run_recipe(tmp_path, recipe: str, steps: int = 1) -> tuple[Path, list[dict]]:
    """`mmyatt train` of a shipped recipe on the shrunken workload: (run dir, metric rows)."""
    run = tmp_path / "run"
    mmyatt(
        tmp_path,
        "train",
        str(ROOT / "configs" / recipe),
        *[o for o in SMALL if not o.startswith("trainer.steps")],
        f"trainer.steps={steps}",
        *RECIPES[recipe],
        "--run-dir",
        str(run),
    )
    return run, [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# the tiny GenEval recipes run in `make test-slow`: they keep `make test` under 15 minutes
SLOW = {"flow_grpo_geneval_tiny.yaml", "flow_nft_geneval_tiny.yaml"}


@pytest.mark.parametrize(
    "recipe",
    [pytest.param(r, marks=pytest.mark.slow) if r in SLOW else r for r in sorted(RECIPES)],
)
def test_recipe_runs_one_step(tmp_path, recipe):
    run, rows = run_recipe(tmp_path, recipe)
    assert "eval/reward/mean" in rows[0] and "eval/reward/mean" in rows[-1]
    if recipe == "flow_nft_pairwise_tiny.yaml":  # win rates, and the pointwise P(Yes) beside
        want = {"genrm_pairwise", "genrm_yes", "prompt_alignment_rule", "shape_critic"}
        assert {f"eval/heldout/reward/{k}" for k in want} <= set(rows[-1])
        train = [r for r in rows if "reward/genrm_pairwise" in r]
        # a win rate against the other samples of its group is in [0, 1] and averages 1/2
        assert train and all(r["reward/genrm_pairwise"] == pytest.approx(0.5) for r in train)
    elif "genrm" in recipe and recipe.startswith("flow_"):  # judged reward, rule, critic
        want = {"genrm", "prompt_alignment_rule", "shape_critic"}
        assert {f"eval/heldout/reward/{k}" for k in want} <= set(rows[-1])
        assert rows[-1]["eval/reward/genrm_parse_failed"] == 0.0
    if recipe == "vlm_genrm_score_tiny.yaml":  # a parsed score, and the independent check
        want = {"genrm", "describe_check", "describe_false_claims", "answer_words"}
        assert {f"eval/heldout/reward/{k}" for k in want} <= set(rows[-1])
        assert 0.0 <= rows[-1]["eval/reward/genrm_parse_failed"] <= 1.0
    if recipe == "vlm_genrm_tiny.yaml":  # the judge, the independent check, the guards
        want = {"genrm", "describe_check", "describe_false_claims", "answer_words"}
        want |= {"describe_colour", "describe_shape", "describe_direction"}
        assert {f"eval/heldout/reward/{k}" for k in want} <= set(rows[-1])
        assert {f"eval/seen/reward/{k}" for k in want} <= set(rows[-1])
        for task in ("describe_image", "describe_video"):  # images and clips apart
            assert {f"eval/heldout/{task}/reward/{k}" for k in want} <= set(rows[-1])
    elif "geneval" in recipe:  # judge, checker and rule, overall and per prompt kind
        want = {"genrm", "geneval_check", "geneval_rule"}
        assert {f"eval/heldout/reward/{k}" for k in want} <= set(rows[-1])
        assert rows[-1]["eval/reward/genrm_parse_failed"] == 0.0
        for kind in ("single", "counting", "two_objects", "colour_attr", "position"):
            assert f"eval/heldout/{kind}/reward/geneval_check" in rows[-1]
    elif not recipe.startswith("vlm_"):  # records of one kind: no per-task groups
        assert not [k for k in rows[-1] if k.count("/") > 3 and k.startswith("eval/heldout/")]
    assert any("reward/generated_mean" in r for r in rows)
    assert (run / "checkpoints" / "final").exists()
    assert list((run / "samples").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == summary["steps_planned"] == 1
    assert summary["cut_by_time"] is False
    if recipe.startswith("flow_"):  # held-out and seen combinations, and the texture check
        last = rows[-1]
        assert last["eval/reward/mean"] == last["eval/heldout/reward/mean"]
        assert "eval/seen/reward/mean" in last
        # the texture of drawn images is measured (a blank or NaN image fails), and the
        # summary's ratio is the last eval's over the base model's
        first = rows[0]["eval/quality/background_hf"]
        assert 0.0 < first < 1.0 and 0.0 < last["eval/quality/background_hf"] < 1.0
        ratio = summary["metrics"]["eval/quality/background_hf"]["ratio"]
        assert ratio == pytest.approx(last["eval/quality/background_hf"] / first)
        assert 0.5 < ratio < 2.0  # one small step does not change the texture much
