"""``reward.judge.backend: vllm`` against a real ``vllm serve`` of the built-in judge.

The same one-step GenRM image run twice on the same seed: once with the built-in judge
server, once with vLLM serving the same judge weights. Both answer the same requests
(OpenAI chat completions with top log-probs), so the judged reward must agree up to the
two engines' numerics. Runs where vLLM is installed (``make test-vllm``); elsewhere it
skips, and ``MMYATT_REQUIRE_VLLM=1`` turns that skip into a failure.
"""

from __future__ import annotations

import json

import pytest
from test_cli import ROOT, mmyatt
from test_recipes import SMALL as ONE_STEP

from mmyatt.engines import available

# the recipes' one-step overrides (later keys win), with 8 eval prompts and 3 denoising steps
SMALL = [
    *ONE_STEP,
    "data.eval_prompts=8",
    "data.synthetic_train_size=16",
    "sampling.denoise_steps=3",
    "sampling.eval_denoise_steps=3",
]


def _judged(tmp_path, name: str, *overrides: str) -> dict:
    run = tmp_path / name
    mmyatt(
        tmp_path,
        "train",
        str(ROOT / "configs" / "flow_grpo_genrm_tiny.yaml"),
        *SMALL,
        *overrides,
        "--run-dir",
        str(run),
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return rows[0]  # the step-0 eval: the same images, judged before any update


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed (see docs/engines.md)")
def test_real_vllm_serve_judges_as_the_builtin_server(tmp_path):
    ours = _judged(tmp_path, "mmyatt")
    theirs = _judged(
        tmp_path,
        "vllm",
        "reward.judge.backend=vllm",
        "reward.judge.startup_timeout_s=900",  # vLLM's start imports and profiles for minutes
        "reward.judge.vllm_args=[--dtype, float32, --max-model-len, '512']",
    )
    key = "eval/reward/genrm"
    assert 0.0 < ours[key] < 1.0  # a P(Yes) that the check can see move
    assert theirs[key] == pytest.approx(ours[key], abs=2e-3)
    assert theirs["eval/reward/genrm_parse_failed"] == ours["eval/reward/genrm_parse_failed"] == 0
    # the rest of the step does not depend on the judge's server
    assert theirs["eval/heldout/reward/prompt_alignment_rule"] == pytest.approx(
        ours["eval/heldout/reward/prompt_alignment_rule"]
    )
