"""LoRA on the text and VLM policies and what a LoRA policy's weight sync moves (no vLLM:
a stand-in engine that reads the adapter folders the sync writes; the real engine is
tests/test_lora_sync_vllm.py, ``make test-vllm``).

- the adapter math and layout on a hand-worked 2 x 2 layer (merged weight, peft names,
  bytes);
- the text policy: only the adapter trains, it starts as the base, and ``save`` writes a
  plain checkpoint (adapter merged) that reloads to the same log-probs;
- the VLM policy: the adapter sits on the language model only;
- the rollout engine's sync: a LoRA policy sends its adapter (never the full weights),
  a new version per update, and the engine's greedy samples equal the trainer's; a full
  fine-tune sends its whole weights; both log ``sync/bytes`` and ``sync/seconds``;
- bytes on the recipes' models: the adapter is at most 1/10 of the full weights;
- the rollout side's copy (``adapter_state`` / ``load_adapter_state``) follows the
  trained model from the adapter alone.
"""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_engines_vllm import PROMPTS, GreedyEngine
from test_text_policy import CORPUS
from torch import nn

from mmyatt.bench.lora_sync import bench_lora_sync
from mmyatt.config.schema import ModelConfig
from mmyatt.distributed import Dist
from mmyatt.engines import ReplicaEngine
from mmyatt.engines.vllm_lora import CONFIG, WEIGHTS, lora_engine_args, tensor_bytes
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
from mmyatt.models.lora import (
    adapter_state,
    adapter_tensors,
    add_lora,
    base_weights,
    load_adapter_state,
)
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling
from mmyatt.step.adapters import build_policy
from mmyatt.step.async_rollouts import load_weights, sampling_weights

LORA = {"r": 4, "alpha": 8}
GREEDY = Sampling(max_new_tokens=6, greedy=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)


def move_adapter(policy, scale: float = 0.3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.module().named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * scale)


# ------------------------------------------------------------------ the adapter itself
class OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(2, 2, bias=False)


def test_adapter_layout_and_merge_hand_worked():
    """W = I, A = [[1, 2]], B = [[1], [0]], alpha / r = 2: W + 2 B A = [[3, 4], [0, 1]]."""
    m = OneLayer()
    with torch.no_grad():
        m.q_proj.weight.copy_(torch.eye(2))
    opts = add_lora(m, {"r": 1, "alpha": 2})
    targets = ["k_proj", "o_proj", "q_proj", "v_proj"]  # the defaults (only q_proj exists)
    assert opts == {"r": 1, "alpha": 2.0, "target_modules": targets, "dropout": 0.0}
    with torch.no_grad():
        m.q_proj.lora_A["default"].weight.copy_(torch.tensor([[1.0, 2.0]]))
        m.q_proj.lora_B["default"].weight.copy_(torch.tensor([[1.0], [0.0]]))
    assert [n for n, p in m.named_parameters() if p.requires_grad] == [
        "q_proj.lora_A.default.weight",
        "q_proj.lora_B.default.weight",
    ]
    merged = base_weights(m, merged=True)
    assert list(merged) == ["q_proj.weight"]
    assert torch.equal(merged["q_proj.weight"], torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    assert torch.equal(base_weights(m, merged=False)["q_proj.weight"], torch.eye(2))
    x = torch.tensor([[1.0, -1.0]])
    assert torch.equal(m.q_proj(x), x @ merged["q_proj.weight"].T)  # = [[-1, -1]]
    t = adapter_tensors(m)
    assert set(t) == {
        "base_model.model.q_proj.lora_A.weight",
        "base_model.model.q_proj.lora_B.weight",
    }
    assert tensor_bytes(t) == (2 + 2) * 4  # float32 A (1 x 2) and B (2 x 1)
    t["base_model.model.q_proj.lora_B.weight"].mul_(7)  # copies: a receiver may scale them
    assert torch.equal(m.q_proj.lora_B["default"].weight, torch.tensor([[1.0], [0.0]]))


def test_adapter_options_are_checked():
    with pytest.raises(ValueError, match="unknown LoRA options"):
        add_lora(OneLayer(), {"rank": 4})
    with pytest.raises(ValueError, match="match no linear layer"):
        add_lora(OneLayer(), {"r": 1, "target_modules": ["gate_proj"]})
    assert lora_engine_args({"r": 4})["max_lora_rank"] == 8  # vLLM's smallest rank >= 4
    with pytest.raises(ValueError, match="up to 512"):
        lora_engine_args({"r": 1024})


def test_tied_weights_count_once():
    w = torch.zeros(3, 4)
    assert tensor_bytes({"embed": w, "lm_head": w}) == 48
    assert tensor_bytes({"embed": w, "lm_head": w.clone()}) == 96


# ------------------------------------------------------------------ the policies
def test_text_lora_trains_the_adapter_only_and_saves_merged(model_dir, tmp_path):
    base = TextPolicy.load(model_dir, max_prompt_tokens=16)
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    trained = [n for n, p in policy.module().named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    r = base.generate(PROMPTS, 2, GREEDY, [1, 2])
    torch.testing.assert_close(policy.logprobs(r), base.logprobs(r), atol=1e-6, rtol=0)  # B = 0
    move_adapter(policy)
    moved = policy.logprobs(r)
    assert (moved - base.logprobs(r)).abs().max() > 1e-2
    policy.save(str(tmp_path / "out"))
    again = TextPolicy.load(tmp_path / "out", max_prompt_tokens=16)
    assert not any(".lora_" in n or "base_layer" in n for n, _ in again.module().named_parameters())
    torch.testing.assert_close(again.logprobs(r), moved, atol=1e-5, rtol=0)


def test_model_lora_rank_gives_the_text_policy_an_adapter(model_dir):
    m = ModelConfig(kind="text", path=str(model_dir), lora={"rank": 4, "alpha": 8})
    policy = build_policy(m)
    assert policy.lora == {
        **LORA,
        "alpha": 8.0,
        "target_modules": sorted(["q_proj", "k_proj", "v_proj", "o_proj"]),
        "dropout": 0.0,
    }
    assert build_policy(ModelConfig(kind="text", path=str(model_dir))).lora is None


def test_vlm_lora_adapts_the_language_model_only(tmp_path):
    path = build_tiny_vlm(tmp_path / "vlm", size="small", corpus=CORPUS)
    policy = VLMPolicy.load(path, max_prompt_tokens=64, lora=LORA)
    trained = [n for n, p in policy.module().named_parameters() if p.requires_grad]
    assert trained and all("language_model" in n and ".lora_" in n for n in trained)
    assert not any("visual" in n and ".lora_" in n for n, _ in policy.module().named_parameters())
    move_adapter(policy)
    policy.save(str(tmp_path / "out"))
    again = VLMPolicy.load(tmp_path / "out", max_prompt_tokens=64)
    merged = base_weights(policy.module(), merged=True)
    for k, v in again.module().state_dict().items():
        torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=0)


# ------------------------------------------------------------------ the engine's sync
class LoRAEngine(GreedyEngine):
    """The stand-in engine with vLLM's adapter calls (``add_lora`` / ``remove_lora`` of
    ``LLMEngine``): it reads the folder a request names, as vLLM does, into its own copy
    of the base model with an adapter, and serves it when a request names it."""

    lora_request_class = SimpleNamespace

    def __init__(self, model):
        super().__init__(model)
        self.adapters: dict[int, dict] = {}
        self.served: list[int] = []

    def add_lora(self, request) -> bool:
        folder = Path(request.lora_path)
        config = json.loads((folder / CONFIG).read_text())
        assert config["r"] == LORA["r"] and config["lora_alpha"] == LORA["alpha"]
        self.adapters[request.lora_int_id] = load_file(str(folder / WEIGHTS))
        return True

    def load_weights(self, weights):
        """Whole weights by their plain names (peft's ``base_layer`` under an adapter)."""
        self.loads.append(dict(weights))
        own = self.model.state_dict()
        state = {}
        for k, v in weights.items():
            module, leaf = k.rsplit(".", 1)
            state[k if k in own else f"{module}.base_layer.{leaf}"] = v
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and all(".lora_" in k for k in missing), (missing, unexpected)

    def remove_lora(self, lora_id: int) -> bool:
        return self.adapters.pop(lora_id, None) is not None

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        tensors = self.adapters[lora_request.lora_int_id]
        state = {
            k.removeprefix("base_model.model.")
            .replace(".lora_A.", ".lora_A.default.")
            .replace(".lora_B.", ".lora_B.default."): v
            for k, v in tensors.items()
        }
        load_adapter_state(self.model, state)
        self.served.append(lora_request.lora_int_id)
        return super().generate(requests, params)


def test_lora_policy_syncs_its_adapter_only(model_dir):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    hf = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    engine = LoRAEngine(TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA).module())
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine)
    adapter = tensor_bytes(adapter_tensors(policy.module()))
    full = tensor_bytes(ReplicaEngine(Dist()).full_weights(TextPolicy.load(model_dir)))
    folders = []
    for version in (1, 2, 3):
        if version > 1:
            move_adapter(policy, seed=version)
        hf.module().load_state_dict(policy.module().state_dict())
        got, want = v.generate(PROMPTS, 1, GREEDY, [1, 2]), hf.generate(PROMPTS, 1, GREEDY, [1, 2])
        assert torch.equal(got.actions, want.actions), version
        m = v.rollout_stats(got)
        assert m["sync/bytes"] == adapter and m["sync/seconds"] > 0, m
        assert set(engine.adapters) == {version} and engine.served[-1] == version
        folders.append(Path(v._lora.request.lora_path))
        assert [f.exists() for f in folders] == [False] * (version - 1) + [True]
    assert engine.loads == []  # the full weights never went
    assert adapter * 10 <= full, (adapter, full)
    again = v.generate(PROMPTS, 1, GREEDY, [1, 2])  # no update: no sync
    assert "sync/bytes" not in v.rollout_stats(again) and engine.served[-1] == 3
    v.close()
    assert not folders[-1].exists()


def test_full_fine_tune_syncs_its_whole_weights(model_dir):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    engine = GreedyEngine(TextPolicy.load(model_dir, max_prompt_tokens=16).module())
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine)
    with torch.no_grad():
        next(policy.module().parameters()).add_(0.01)
    r = v.generate(PROMPTS, 1, GREEDY, [1, 2])
    m = v.rollout_stats(r)
    assert m["sync/bytes"] == tensor_bytes(policy.module().state_dict()) and m["sync/seconds"] > 0
    assert len(engine.loads) == 1


def test_level_2_sleep_sends_a_lora_policys_base_again(model_dir):
    """Level-2 sleep drops the engine's weights: after the wake the base goes again,
    then the adapter (the GPU path, driven here with the stand-in engine)."""
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    engine = LoRAEngine(TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA).module())
    engine.sleep = engine.wake_up = lambda **kw: None
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine, sleep_level=2)
    v._can_sleep = lambda: True
    v.generate(PROMPTS, 1, GREEDY, [1, 2])
    assert engine.loads == [] and set(engine.adapters) == {1}
    v.generate(PROMPTS, 1, GREEDY, [1, 2])  # woken: base weights, then adapter v2
    assert [set(w) for w in engine.loads] == [set(base_weights(policy.module(), merged=False))]
    assert set(engine.adapters) == {2}


def test_megatron_has_no_lora_path(model_dir):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    with pytest.raises(ValueError, match="train.backend=replica or fsdp2"):
        VLLMRolloutPolicy(policy, SimpleNamespace(name="megatron"), Dist())


# ------------------------------------------------------------------ the recipes' models
def test_lora_sync_is_a_tenth_of_full_sync_on_the_recipes_models():
    """Rank 8 on the text, VLM and flow recipes' policy models: the adapter's bytes are
    at most 1/10 of the whole weights a full fine-tune sends."""
    rows = bench_lora_sync(quick=True)["models"]
    assert {r["kind"] for r in rows.values()} == {"text", "vlm", "flow"}
    for name, row in rows.items():
        assert 0 < row["lora_bytes"] * 10 <= row["full_bytes"], (name, row)


def test_rollout_copy_follows_from_the_adapter_alone(model_dir):
    trained = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    copy = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    move_adapter(trained)
    state = adapter_state(trained.module())
    assert state and all(".lora_" in k for k in state)
    load_adapter_state(copy.module(), state)
    r = trained.generate(PROMPTS, 2, GREEDY, [1, 2])
    assert torch.equal(copy.logprobs(r), trained.logprobs(r))
    with pytest.raises(ValueError, match="does not fit"):
        load_adapter_state(copy.module(), dict(list(state.items())[1:]))


def test_async_rollout_copy_of_a_lora_policy_gets_the_adapter_only(model_dir):
    """trainer.async's rollout copy: a LoRA policy's snapshot is its adapter, and loading
    it makes the copy score as the trained policy; a full fine-tune's is every weight."""
    trained = TextPolicy.load(model_dir, max_prompt_tokens=16, lora=LORA)
    rollout_side = copy.deepcopy(trained)
    move_adapter(trained)
    snap = sampling_weights(trained, nullcontext)
    assert snap and all(".lora_" in k for k in snap)
    assert set(snap) == set(adapter_state(trained.module()))
    load_weights(rollout_side, snap)
    r = trained.generate(PROMPTS, 2, GREEDY, [1, 2])
    assert torch.equal(rollout_side.logprobs(r), trained.logprobs(r))
    with pytest.raises(ValueError, match="does not fit"):
        load_weights(rollout_side, dict(list(snap.items())[1:]))
    full = TextPolicy.load(model_dir, max_prompt_tokens=16)
    assert set(sampling_weights(full, nullcontext)) == set(full.module().state_dict())
