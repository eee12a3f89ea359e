"""The adapters and the engine on a CUDA device (``pytest -m gpu``; skipped without one).

The CPU contract suites run again with every policy's weights on the GPU, then short
`mmyatt train` runs with the policy on cuda:0 and NCCL between controllers. Exactness
checks of the contract (first-update ratio 1, rank invariance) hold on the GPU only
where its kernels are deterministic for the shapes involved; a failure here names the
adapter and the check.
"""

from __future__ import annotations

import os

import pytest
import test_flow_policy as flow_tests
import test_text_policy as text_tests
import test_vlm_policy as vlm_tests
import torch
from test_recipes import run_recipe

from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy

# MMYATT_TEST_DEVICE=cpu runs the same wiring on the CPU (a dry run of this file)
DEV = os.environ.get("MMYATT_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return text_tests.build_tiny_text_model(
        tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=text_tests.CORPUS
    )


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return vlm_tests.build_tiny_vlm(
        tmp_path_factory.mktemp("tiny_vlm"), arch="qwen2-vl", corpus=vlm_tests.CORPUS
    )


class TestTextPolicyOnCUDA(text_tests.TestTextPolicyContract):
    @pytest.fixture(autouse=True)
    def _model_dir(self, text_dir):
        self.model_dir = text_dir

    def make_policy(self):
        return TextPolicy.load(self.model_dir, max_prompt_tokens=32, device=DEV)

    def load_policy(self, path):
        return TextPolicy.load(path, max_prompt_tokens=32, device=DEV)


class TestVLMPolicyOnCUDA(vlm_tests.TestVLMPolicyContract):
    @pytest.fixture(autouse=True)
    def _model_dir(self, vlm_dir):
        self.model_dir = vlm_dir

    def make_policy(self):
        return VLMPolicy.load(self.model_dir, max_prompt_tokens=48, device=DEV)

    def load_policy(self, path):
        return VLMPolicy.load(path, max_prompt_tokens=48, device=DEV)


class TestFlowPolicyOnCUDA(flow_tests.TestFlowPolicyContract):
    def make_policy(self):
        return super().make_policy().to(DEV)

    def load_policy(self, path):
        return super().load_policy(path).to(DEV)


def test_policies_really_on_cuda(tmp_path):
    p = flow_tests._policy().to(DEV)
    assert p.device.type == DEV
    r = p.generate(
        [dict(x) for x in flow_tests.PROMPTS], 2, flow_tests.Sampling(denoise_steps=3), [1, 2]
    )
    lp = p.logprobs(r)
    assert lp.device.type == DEV
    torch.testing.assert_close(lp, r.logprobs.to(lp.device), atol=1e-4, rtol=0)


@pytest.mark.parametrize("recipe", ["flow_grpo_tiny.yaml", "vlm_grpo_image_tiny.yaml"])
def test_train_on_cuda(tmp_path, recipe):
    run, rows = run_recipe(tmp_path, recipe, steps=3)
    assert len([r for r in rows if "reward/generated_mean" in r]) == 3
    # a step whose groups all have equal rewards has nothing to train (no train/loss)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert all(torch.isfinite(torch.tensor(x)) for x in losses)
    if recipe.startswith("flow"):
        assert losses
    assert (run / "checkpoints" / "final").exists()
