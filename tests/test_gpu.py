"""The adapters and the engine on a CUDA device (``pytest -m gpu``; skipped without one).

The CPU contract suites run again with every policy's weights on the GPU, then short
`mmyatt train` runs with the policy on cuda:0 and NCCL between controllers. Exactness
checks of the contract (first-update ratio 1, rank invariance) hold on the GPU only
where its kernels are deterministic for the shapes involved; a failure here names the
adapter and the check. The training runs check where the trained weights live (a probe
on the policy the run builds), that the weights and the loss move, and with 2 devices
that controller 0 reports NCCL; without CUDA the whole file is skipped.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os

import pytest
import test_flow_policy as flow_tests
import test_text_policy as text_tests
import test_vlm_policy as vlm_tests
import torch
from test_cli import ROOT, mmyatt
from test_recipes import RECIPES, SMALL

from mmyatt import distributed
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.step import builders
from mmyatt.step.run import train

# MMYATT_TEST_DEVICE=cpu runs the same wiring on the CPU (a dry run of this file)
DEV = os.environ.get("MMYATT_TEST_DEVICE", "cuda")
assert DEV in ("cuda", "cpu"), f"MMYATT_TEST_DEVICE={DEV!r}: cuda or cpu"
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


def test_vlm_vision_features_on_the_device_give_the_pixels_log_probs(vlm_dir):
    """placement.balance for a VLM: encode_media runs the frozen tower on the device, the
    features come back to the CPU (they travel between controllers), and the forward
    from them equals the one from pixels, on the device's kernels."""
    policy = VLMPolicy.load(vlm_dir, max_prompt_tokens=48, device=DEV)
    for name, p in policy.model.named_parameters():
        if "visual." in name:
            p.requires_grad_(False)
    prompts = [
        {"prompt": "What colour is the shape?", "image": vlm_tests.square("red")},
        {"prompt": "Which way does it move?", "video": vlm_tests.moving_frames(4)},
    ]
    r = policy.generate(prompts, 2, vlm_tests.Sampling(max_new_tokens=6), [1, 2])
    e = policy.encode_media(r)
    feats = [m[k] for m in e.context["media"] for k in ("image_embeds", "video_embeds") if k in m]
    assert len(feats) == 4 and all(f.device.type == "cpu" for f in feats)
    with torch.no_grad():
        lp, le = policy.logprobs(r), policy.logprobs(e)
    assert le.device.type == DEV
    torch.testing.assert_close(le, lp, atol=1e-4, rtol=0)


class PolicyProbe:
    """Wraps ``builders.build_policy`` in this process: the policies the run builds (the
    controller's last), and a CPU copy of the last one's trainable weights as built."""

    def __init__(self, monkeypatch):
        self.policies: list = []
        self.before: list[torch.Tensor] = []
        build = builders.build_policy

        def probed(*args, **kwargs):
            policy = build(*args, **kwargs)
            self.policies.append(policy)
            self.before = [p.detach().cpu().clone() for p in self.params(policy)]
            return policy

        monkeypatch.setattr(builders, "build_policy", probed)

    @staticmethod
    def params(policy) -> list[torch.nn.Parameter]:
        return [p for p in policy.module().parameters() if p.requires_grad]


def completion_length(completion: str, record: dict) -> float:
    """A reward that differs between samples from the start, so every group trains."""
    return len(completion) / 10.0


# Small runs, big enough that every step has groups to train on. Without a long SFT the
# VLM's answers never match exactly (every group's rewards are 0, nothing trains), so it
# is paid by length: these runs test the engine on the GPU, not learning.
TRAIN = {
    "flow_grpo_tiny.yaml": ["data.prompts_per_step=4", "sampling.group_size=4"],
    "vlm_grpo_image_tiny.yaml": [
        "data.prompts_per_step=4",
        "sampling.group_size=4",
        "sft.enabled=false",
        "reward.functions=[{name: 'test_gpu:completion_length'}]",
    ],
}


def small_run(recipe: str, steps: int, *extra: str) -> list[str]:
    return [
        *[o for o in SMALL if not o.startswith("trainer.steps")],
        f"trainer.steps={steps}",
        *RECIPES[recipe],
        *TRAIN[recipe],
        *extra,
    ]


def assert_trained(rows: list[dict], steps: int) -> None:
    """Every step generated; the loss is finite and moves; gradients were not zero."""
    assert len([r for r in rows if "reward/generated_mean" in r]) == steps
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) >= 2, f"only {len(trained)} of {steps} steps trained: {rows}"
    losses = [r["train/loss"] for r in trained]
    assert all(math.isfinite(x) for x in losses), losses
    assert max(losses) != min(losses), f"the loss never moved: {losses}"
    assert max(r["train/grad_norm"] for r in trained) > 0


@pytest.mark.parametrize("recipe", sorted(TRAIN))
def test_one_controller_trains_on_cuda(tmp_path, monkeypatch, caplog, recipe):
    """`mmyatt train` with one controller and the default `distributed.device=auto`
    (run in this process, as the CLI does for one controller): the policy it trains
    lives on the GPU, and its weights move."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(distributed, "_announced", [])  # say it again in this process
    caplog.set_level(logging.INFO, logger="mmyatt")
    probe = PolicyProbe(monkeypatch)
    steps, rd = 3, tmp_path / "run"
    assert train(str(ROOT / "configs" / recipe), small_run(recipe, steps), str(rd)) == 0
    assert probe.policies, "the run built no policy through builders.build_policy"
    params = probe.params(probe.policies[-1])  # the controller's (SFT may build one first)
    assert params, "the policy has no trainable parameters"
    assert {p.device.type for p in params} == {DEV}, {str(p.device) for p in params}
    assert len(params) == len(probe.before)
    moved = [not torch.equal(a.detach().cpu(), b) for a, b in zip(params, probe.before)]
    assert any(moved), "training left every weight as it was built"
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert_trained(rows, steps)
    assert (rd / "checkpoints" / "final").exists()
    expected = "cuda:0" if DEV == "cuda" else "cpu"
    assert f"[device] controller 0 of 1 on {expected}" in caplog.text


@pytest.mark.skipif(DEV == "cuda" and torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_controllers_train_with_nccl(tmp_path):
    """`mmyatt train distributed.nproc=2`: controller 0 says it is on cuda:0 with NCCL
    (gloo on the CPU dry run), and the run trains."""
    recipe, steps, rd = "flow_grpo_tiny.yaml", 3, tmp_path / "run"
    device = "cpu" if DEV == "cpu" else "auto"  # the dry run forces the CPU, as a user can
    out = mmyatt(
        tmp_path,
        "train",
        str(ROOT / "configs" / recipe),
        *small_run(recipe, steps, "distributed.nproc=2", f"distributed.device={device}"),
        "--run-dir",
        str(rd),
    )
    expected = "cuda:0, backend nccl" if DEV == "cuda" else "cpu, backend gloo"
    assert f"[device] controller 0 of 2 on {expected}" in out.stdout, out.stdout[-3000:]
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert_trained(rows, steps)


def test_judge_sleep_gives_the_device_memory_back(tmp_path):
    """colocate's release on CUDA: a judge's dropped weights leave the device (its
    allocator's cache emptied), the peak window resets, and wake reloads them there. The
    CPU dry run checks that the device figures stay 0."""
    from mmyatt.placement import resources as res
    from mmyatt.placement.bench_memory import big_model
    from mmyatt.serving.server import JudgeServer

    path, params = big_model(tmp_path / "judge", seed=1)
    weights_mb = params * 4 / 2**20
    # the figures are this process's: earlier tests' garbage is let go first, and the
    # judge's memory is what it adds to that
    gc.collect()
    res.release_free_memory()
    base = res.device_mb()
    server = JudgeServer(str(path), device=DEV)
    try:
        awake = server.stats["device_mb"] - base
        server.batcher.sleep()
        asleep = server.stats["device_mb"] - base
        res.reset_device_peak()
        server.batcher.wake()
        again = server.stats["device_mb"] - base
        peak = server.stats["device_peak_mb"] - base
        on = {p.device.type for p in server.model.model.parameters()}
    finally:
        server.batcher.stop()
        gc.unfreeze()  # the release froze what survived it; the session collects as before
    assert on == {DEV}
    if DEV == "cpu":
        assert awake == asleep == again == peak == 0.0
        return
    assert awake > 0.9 * weights_mb, (awake, weights_mb)
    assert asleep < 0.1 * weights_mb, (asleep, weights_mb)
    assert again > 0.9 * weights_mb and peak >= again, (again, peak, weights_mb)


def _adam_after_one_step(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(8, 256, device=DEV)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return m, opt


def test_policy_offload_moves_weights_and_state_off_the_device():
    """placement.offload_policy on CUDA: the optimizer's state, then the weights, leave the
    device (allocated bytes drop by their size), come back to it, and the next update is
    bitwise the one without the round trip. The CPU dry run checks nothing moved."""
    from mmyatt.placement.offload import PolicyOffload

    m, opt = _adam_after_one_step(0)
    ref_m, ref_opt = _adam_after_one_step(0)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    state = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device.type != "cpu"
    )
    off = PolicyOffload(m, opt)
    assert off.active == (DEV == "cuda")
    before = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    off.optimizer_off()
    after_state = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    off.weights_off()
    after_weights = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    off.on()
    back = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    assert {p.device.type for p in m.parameters()} == {DEV}
    if DEV == "cuda":
        assert state >= 2 * weights  # AdamW: exp_avg and exp_avg_sq
        assert before - after_state >= 0.99 * state, (before, after_state, state)
        assert after_state - after_weights >= 0.99 * weights, (after_state, after_weights)
        assert back == before and off.take_seconds() > 0
    x = torch.randn(8, 256, device=DEV, generator=None)
    for model, o in ((m, opt), (ref_m, ref_opt)):
        model(x).square().mean().backward()
        o.step()
    for a, b in zip(m.parameters(), ref_m.parameters(), strict=True):
        assert torch.equal(a, b)


def test_colocate_offloads_the_policy_while_the_judge_runs(tmp_path):
    """A colocate run on cuda:0 with placement.offload_policy: every step moves the policy
    off and back (placement/policy_offload_s), and the run trains."""
    from test_cli import TINY

    rd = tmp_path / "run"
    out = mmyatt(
        tmp_path,
        "train",
        str(ROOT / "configs" / "text_grpo_tiny.yaml"),
        *TINY,
        "trainer.steps=3",
        f"distributed.device={DEV}",
        "placement.mode=colocate",
        "placement.offload_policy=true",
        "--run-dir",
        str(rd),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "placement/mode" in r]
    assert [r["placement/mode"] for r in steps] == ["colocate"] * 3
    if DEV == "cuda":
        assert all(r["placement/policy_offload_s"] > 0 for r in steps), steps
        # the judge phase ran with the policy away: below the train phase's peak
        assert all(
            r.get("placement/peak_device_mb_judge", 0.0) < r["placement/peak_device_mb_train"]
            for r in steps
        ), steps
    else:
        assert all("placement/policy_offload_s" not in r for r in steps)
