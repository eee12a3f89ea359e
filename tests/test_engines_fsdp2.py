"""train.backend=fsdp2: torch fully_shard over 2 gloo controllers reaches the replica
backend's parameters, resumes exactly, and trains text, VLM and flow policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import ROOT, TINY, mmyatt
from test_recipes import RECIPES, SMALL
from test_resume import stop_and_resume

from mmyatt.config.schema import ConfigError, load_config

TEXT = str(ROOT / "configs" / "text_grpo_tiny.yaml")
LENGTH_REWARD = "def reward(completion, record):\n    return len(completion) / 10.0\n"


def weights(run: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "checkpoints" / "final").rglob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[f"{f.relative_to(run)}:{k}"] = v
    return out


def losses(run: Path, key: str = "train/loss") -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def text_args(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "lenreward.py").write_text(LENGTH_REWARD)  # rewards differ from step 1
    return [
        *[a for a in TINY if not a.startswith("trainer.steps")],
        "distributed.nproc=2",
        "reward.functions=[{name: 'lenreward:reward'}]",
        *extra,
    ]


def test_fsdp2_reaches_the_replica_parameters(tmp_path):
    """The acceptance check: 3 steps on 2 gloo ranks, FSDP2 vs the replica backend."""
    args = text_args(tmp_path, "trainer.steps=3")
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", TEXT, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", TEXT, *args, "train.backend=fsdp2", "--run-dir", str(b))
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()  # tied embeddings written once, as the replica does
    base = load_file(str(a / "base_model" / "model.safetensors"))
    moved = [k for k in wa if not torch.equal(wa[k], base[k.split(":", 1)[1]])]
    assert moved, "training moved no weight: the comparison would prove nothing"
    # AdamW's first steps move every weight by about lr * sign(gradient), so an element
    # whose gradient is at rounding-noise level (never-seen token rows, the k_proj biases
    # whose exact gradient is 0) moves by an amount set by that noise, which depends on
    # the reduction order (one flat all-reduce vs reduce-scatter per block). Measured:
    # 0.1% of elements differ by more than 1e-6, the largest by 4e-5, while the weights
    # moved by 1.8e-2 on average; the mean difference is 2e-8.
    diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
    move = torch.cat([(wa[k] - base[k.split(":", 1)[1]]).abs().flatten() for k in wa])
    assert float(diff.max()) < 2e-4 and float(move.mean()) > 1e-2
    assert float((diff > 1e-6).float().mean()) < 0.01
    assert float(diff.mean()) < 1e-6
    la, lb = losses(a), losses(b)
    assert len(la) == 3 and any(abs(x) > 1e-3 for x in la)
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-6, rtol=1e-5)
    # AdamW cannot tell summed gradients from averaged ones; the gradient norm can
    ga, gb = losses(a, "train/grad_norm"), losses(b, "train/grad_norm")
    torch.testing.assert_close(torch.tensor(gb), torch.tensor(ga), atol=0, rtol=1e-5)


@pytest.mark.slow  # three 2-controller runs (~90 s on a loaded 2-core machine)
def test_fsdp2_stop_and_resume_equals_uninterrupted(tmp_path):
    """Run-state checkpoints of a sharded run (full state dicts from
    torch.distributed.checkpoint.state_dict) resume bit for bit."""
    args = text_args(tmp_path, "train.backend=fsdp2", "checkpoint.save_every=2")
    full, parts, _ = stop_and_resume(tmp_path, TEXT, *args)
    wa, wb = weights(full), weights(parts)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert losses(full) == losses(parts)


@pytest.mark.slow  # two 2-controller flow runs
def test_fsdp2_ema_matches_replica(tmp_path):
    """model.ema_decay under FSDP2: each rank averages its own shard; the checkpoint's
    (whole) EMA weights and the final weights equal the replica backend's after 3 steps,
    and the EMA differs from the weights (it is really averaged)."""
    recipe = "flow_grpo_tiny.yaml"
    args = [
        *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
        *RECIPES[recipe],
        "trainer.steps=3",
        "distributed.nproc=2",
        "data.prompts_per_step=2",
        "sampling.group_size=4",
        "model.ema_decay=0.5",
        "checkpoint.save_every=3",
    ]
    cfg = str(ROOT / "configs" / recipe)
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=fsdp2", "--run-dir", str(b))

    def shared(run):
        (f,) = sorted(run.rglob("shared.safetensors"))[-1:]
        return load_file(str(f))

    sa, sb = shared(a), shared(b)
    ema = [k for k in sa if "ema" in k.split("/")[0].split(".")[0]]
    assert ema and set(ema) <= set(sb)
    for k in ema:
        torch.testing.assert_close(sb[k], sa[k], atol=1e-5, rtol=1e-4, msg=k)
    wa, wb = weights(a), weights(b)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    model = {k.split("model", 1)[1]: v for k, v in sa.items() if k.split("/")[0] == "model"}
    assert any(not torch.equal(sa[k], model.get(k.split("ema", 1)[1], sa[k])) for k in ema)


@pytest.mark.slow  # three 2-controller flow runs
def test_fsdp2_ema_resumes_exactly(tmp_path):
    """A sharded EMA saved whole and re-sharded on resume: 4 steps = 2 + resume to 4."""
    recipe = "flow_grpo_tiny.yaml"
    args = [
        *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
        *RECIPES[recipe],
        "distributed.nproc=2",
        "data.prompts_per_step=2",
        "sampling.group_size=4",
        "model.ema_decay=0.5",
        "checkpoint.save_every=2",
        "train.backend=fsdp2",
    ]
    cfg = str(ROOT / "configs" / recipe)
    full, parts, _ = stop_and_resume(tmp_path, cfg, *args)

    def last_shared(run):
        return load_file(str(sorted(run.rglob("shared.safetensors"))[-1]))

    sa, sb = last_shared(full), last_shared(parts)
    ema = [k for k in sa if k.split("/")[0] == "ema"]
    assert ema
    for k in ema:
        assert torch.equal(sa[k], sb[k]), k
    assert losses(full) == losses(parts)


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, 1])
@pytest.mark.parametrize("recipe", ["vlm_grpo_image_tiny.yaml", "flow_grpo_tiny.yaml"])
def test_fsdp2_matches_replica_vlm_and_flow(tmp_path, recipe, micro):
    """VLM (vision blocks and decoder layers sharded) and flow (transformer blocks).
    ``micro``: the FSDP2 run cuts each rank's 2 groups into micro-batches of one group
    (``algorithm.micro_batch_tokens=1``), the replica run makes one pass."""
    (tmp_path / "lenreward.py").write_text(LENGTH_REWARD)
    extra = list(RECIPES[recipe])
    if recipe.startswith("vlm"):
        extra += ["sft.enabled=false", "reward.functions=[{name: 'lenreward:reward'}]"]
    args = [
        *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
        *extra,
        "trainer.steps=2",
        "distributed.nproc=2",
        f"data.prompts_per_step={4 if micro else 2}",
        "sampling.group_size=4",
    ]
    cfg = str(ROOT / "configs" / recipe)
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    fsdp2 = ["train.backend=fsdp2", f"algorithm.micro_batch_tokens={micro}"]
    mmyatt(tmp_path, "train", cfg, *args, *fsdp2, "--run-dir", str(b))
    if micro:  # 2 micro-batches on each rank in the update
        assert set(losses(b, "train/micro_batches")) == {4.0}, losses(b, "train/micro_batches")
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    if micro:  # another summation order: AdamW's rounding-noise allowance (text test above)
        diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
        assert float(diff.max()) < 2e-4 and float(diff.mean()) < 1e-6
        assert float((diff > 1e-6).float().mean()) < 0.01
    else:
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    assert losses(a) and len(losses(a)) == len(losses(b))


def test_fsdp2_options_single_process(tmp_path):
    """One controller (a process group of one): bfloat16 mixed precision and activation
    checkpointing run on CPU and train; CPU offload is refused on a CPU policy."""
    from test_text_policy import CORPUS

    from mmyatt.distributed import Dist
    from mmyatt.engines.fsdp2 import FSDP2Engine, shard_units
    from mmyatt.models.builtin.tiny import build_tiny_text_model
    from mmyatt.models.text import TextPolicy
    from mmyatt.protocols import Sampling

    path = build_tiny_text_model(tmp_path / "m", size="qwen2-0.1m", corpus=CORPUS)
    policy = TextPolicy.load(path, max_prompt_tokens=16)
    units = shard_units(policy.module())
    assert [type(u).__name__ for u in units] == ["Qwen2DecoderLayer"] * 2
    with pytest.raises(ValueError, match="GPU option"):
        FSDP2Engine(Dist(), cpu_offload=True).wrap(TextPolicy.load(path, max_prompt_tokens=16))
    engine = FSDP2Engine(Dist(), mixed_precision="bfloat16", activation_checkpointing=True)
    wrapped = engine.wrap(policy)
    params = [p for p in wrapped.module().parameters() if p.requires_grad]
    before = [p.full_tensor().clone() for p in params]
    r = wrapped.generate([{"prompt": "1+2=", "_index": 0}], 4, Sampling(max_new_tokens=4), [7])
    assert engine.filler is not None and len(engine.filler) == 2 and len(r) == 4
    lp = wrapped.logprobs(r)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    # bf16 compute: the recomputed log-probs are close to, not equal to, the sampled ones
    torch.testing.assert_close(lp, r.logprobs, atol=0.1, rtol=0)
    opt = torch.optim.AdamW(params, lr=1e-2)
    (-(lp * r.mask).sum()).backward()
    norm = engine.reduce_and_clip(params, 1.0)
    assert norm > 0 and not hasattr(norm, "full_tensor")
    opt.step()
    assert any(not torch.equal(p.full_tensor(), b) for p, b in zip(params, before))
    engine.export(wrapped, str(tmp_path / "out"))
    again = TextPolicy.load(tmp_path / "out", max_prompt_tokens=16)
    got = dict(again.module().named_parameters())
    for n, p in wrapped.module().named_parameters():
        torch.testing.assert_close(got[n], p.full_tensor(), atol=0, rtol=0)
    import torch.distributed as tdist

    tdist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.mixed_precision=bfloat16"], "FSDP2 options"),
        (["train.backend=megatron", "model.kind=vlm"], "text LLMs"),
        (["train.backend=megatron", "train.tensor_parallel=2"], "multiple of it"),
        (
            ["train.backend=megatron", "train.tensor_parallel=2", "distributed.nproc=2"]
            + ["rollout.backend=vllm"],
            "rollout.backend=vllm",
        ),
        (
            ["train.backend=megatron", "train.tensor_parallel=2", "distributed.nproc=2"]
            + ["placement.balance=true"],
            "placement.balance=false",
        ),
    ],
)
def test_engine_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, extra",
    [(["train.backend=megatron"], "megatron"), (["rollout.backend=vllm"], "vllm")],
)
def test_missing_engine_fails_at_start_with_the_install_command(monkeypatch, overrides, extra):
    from mmyatt.engines import install

    monkeypatch.setattr(install, "available", lambda name: False)
    with pytest.raises(ConfigError, match=rf"pip install 'mmyatt\[{extra}\]'"):
        load_config(None, overrides)


@pytest.mark.slow  # two 2-controller runs
def test_fsdp2_rank_without_samples_joins_the_update(tmp_path):
    """Dynamic sampling leaves one rank with the step's only group and the other with
    none (a reward constant on 2 of 3 prompts): the empty rank runs zero-weight passes
    on a two-row filler, the run finishes and matches the replica backend."""
    (tmp_path / "oddreward.py").write_text(
        "def reward(completion, record):\n"
        "    return 1.0 if record['_index'] % 3 else len(completion) / 10.0\n"
    )
    args = [
        *[a for a in TINY if not a.startswith(("trainer.steps", "algorithm.dynamic"))],
        "trainer.steps=2",
        "distributed.nproc=2",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_refill_rounds=0",
        "algorithm.minibatches=2",
        "reward.functions=[{name: 'oddreward:reward'}]",
    ]
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", TEXT, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", TEXT, *args, "train.backend=fsdp2", "--run-dir", str(b))
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    kept = [r["dynamic/kept_groups"] for r in rows if "dynamic/kept_groups" in r]
    assert 1.0 in kept, kept  # one group in all: a rank held none that step
    wa, wb = weights(a), weights(b)
    diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
    # the same AdamW rounding-noise allowance as test_fsdp2_reaches_the_replica_parameters
    assert float(diff.max()) < 2e-4 and float(diff.mean()) < 1e-6
    assert float((diff > 1e-6).float().mean()) < 0.01
    torch.testing.assert_close(
        torch.tensor(losses(b, "train/grad_norm")), torch.tensor(losses(a, "train/grad_norm"))
    )


NFT = [
    *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
    *RECIPES.get("flow_nft_tiny.yaml", ["data.synthetic_train_size=16"]),
    "sampling.denoise_steps=3",
    "sampling.eval_denoise_steps=3",
    "distributed.nproc=2",
    "data.prompts_per_step=2",
    "sampling.group_size=4",
    "algorithm.nft.decay_rate=0.25",  # the sampling policy really trails: d = 0.25, 0.5
    "algorithm.nft.decay_max=0.5",
]


@pytest.mark.slow  # two 2-controller flow runs
def test_fsdp2_diffusion_nft_matches_replica(tmp_path):
    """DiffusionNFT under FSDP2: the sampling policy is a plain copy taken before
    sharding, its EMA reads the sharded weights gathered one by one; after 3 steps the
    weights and the sampling policy in the checkpoint equal the replica run's."""
    cfg = str(ROOT / "configs" / "flow_nft_tiny.yaml")
    args = [*NFT, "trainer.steps=3", "checkpoint.save_every=3"]
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=fsdp2", "--run-dir", str(b))
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)

    def shared(run):
        return load_file(str(sorted(run.rglob("shared.safetensors"))[-1]))

    sa, sb = shared(a), shared(b)
    old = [k for k in sa if k.split("/")[0] == "nft_old"]
    assert old and set(old) <= set(sb)
    for k in old:
        torch.testing.assert_close(sb[k], sa[k], atol=1e-5, rtol=1e-4, msg=k)
    model = {k.split("/", 1)[1]: v for k, v in sa.items() if k.split("/")[0] == "model"}
    # the sampling policy trails the weights: it differs from them
    assert any(not torch.equal(sa[k], model.get(k.split("/", 1)[1], sa[k])) for k in old)
    la, lb = losses(a), losses(b)
    assert len(la) == 3 and any(abs(x) > 1e-4 for x in la)
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # three 2-controller flow runs
def test_fsdp2_diffusion_nft_resumes_exactly(tmp_path):
    """DiffusionNFT under FSDP2: 4 steps uninterrupted = 2 steps + resume to 4, bit for bit
    (weights, sampling policy, losses)."""
    cfg = str(ROOT / "configs" / "flow_nft_tiny.yaml")
    args = [*NFT, "checkpoint.save_every=2", "train.backend=fsdp2"]
    full, parts, _ = stop_and_resume(tmp_path, cfg, *args)
    sa = load_file(str(sorted(full.rglob("shared.safetensors"))[-1]))
    sb = load_file(str(sorted(parts.rglob("shared.safetensors"))[-1]))
    assert any(k.startswith("nft_old/") for k in sa) and sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    wa, wb = weights(full), weights(parts)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert losses(full) == losses(parts)


@pytest.mark.slow  # two 2-controller flow runs
def test_fsdp2_diffusion_nft_rank_without_samples(tmp_path):
    """Dynamic sampling leaves one rank without a group: it runs the NFT loss on its
    filler (weight 0, rows padded to the other rank's), the run finishes and matches
    the replica backend."""
    (tmp_path / "oddreward.py").write_text(
        "import numpy as np\n\n\n"
        "def reward(image, record):\n"
        "    if record['_index'] % 2:\n"
        "        return 1.0\n"
        "    return float(np.asarray(image, dtype=np.float32).mean())\n"
    )
    cfg = str(ROOT / "configs" / "flow_nft_tiny.yaml")
    args = [
        *NFT,
        "trainer.steps=3",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_refill_rounds=0",
        "reward.functions=[{name: 'oddreward:reward'}]",
    ]
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=fsdp2", "--run-dir", str(b))
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    kept = [r["dynamic/kept_groups"] for r in rows if "dynamic/kept_groups" in r]
    assert 1.0 in kept, kept  # one group in all: a rank held none that step
    wa, wb = weights(a), weights(b)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    torch.testing.assert_close(torch.tensor(losses(b)), torch.tensor(losses(a)))


@pytest.mark.slow  # two 2-controller flow runs
def test_fsdp2_flow_grpo_ranks_with_unequal_rows(tmp_path):
    """Flow-GRPO with dynamic sampling: a reward constant on every third prompt drops 1 of
    4 groups, so one rank trains 2 groups and the other 1 (8 rows against 4). The sharded
    log-prob and loss passes still pair up across ranks, and the weights equal the
    replica backend's."""
    (tmp_path / "oddreward.py").write_text(
        "import numpy as np\n"
        "from mmyatt.rewards.image import _frames\n"
        "def reward(output, record):\n"
        "    a = np.asarray(_frames(output)[0], dtype=np.float32)\n"
        "    return 1.0 if record['_index'] % 3 == 0 else float(a.mean()) / 255.0\n"
    )
    recipe = "flow_grpo_tiny.yaml"
    args = [
        *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
        *RECIPES[recipe],
        "trainer.steps=2",
        "distributed.nproc=2",
        "data.prompts_per_step=4",
        "sampling.group_size=4",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_refill_rounds=0",
        "reward.functions=[{name: 'oddreward:reward'}]",
    ]
    cfg = str(ROOT / "configs" / recipe)
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=fsdp2", "--run-dir", str(b))
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    kept = [r["dynamic/kept_groups"] for r in rows if "dynamic/kept_groups" in r]
    assert kept and all(k % 2 == 1 for k in kept), kept  # an odd count: ranks unequal
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    assert losses(a) == pytest.approx(losses(b), rel=1e-4, abs=1e-6)


def test_fsdp2_micro_batches_match_the_replica_in_one_pass(tmp_path):
    """algorithm.micro_batch_tokens under FSDP2: micro-batches of whole groups, as many on
    each rank as on the fullest (a rank with fewer runs zero-weight passes), with
    recomputed old log-probs and a reference KL, each a sharded forward. Dynamic
    sampling leaves the ranks different numbers of groups, so the counts differ before
    they are made equal; the run finishes and reaches the one-pass replica's weights."""
    (tmp_path / "oddreward.py").write_text(
        "def reward(completion, record):\n"
        "    return 1.0 if record['_index'] % 3 else len(completion) / 10.0\n"
    )
    args = [
        *[a for a in TINY if not a.startswith(("trainer.steps", "algorithm.dynamic"))],
        *("trainer.steps=3", "distributed.nproc=2", "data.prompts_per_step=6"),
        *("sampling.max_new_tokens=12", "algorithm.minibatches=2"),
        *("algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=0"),
        *("algorithm.recompute_old_logprobs=true", "algorithm.kl_coef=0.05"),
        "reward.functions=[{name: 'oddreward:reward'}]",
    ]
    a, b = tmp_path / "replica", tmp_path / "fsdp2"
    mmyatt(tmp_path, "train", TEXT, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(
        tmp_path, "train", TEXT, *args, "train.backend=fsdp2",
        "algorithm.micro_batch_tokens=20", "--run-dir", str(b),
    )  # fmt: skip
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    kept = [r["dynamic/kept_groups"] for r in rows if "dynamic/kept_groups" in r]
    micro = [r["train/micro_batches"] for r in rows if "train/micro_batches" in r]
    assert any(k % 2 for k in kept), kept  # an odd number of groups: the ranks differ
    assert any(m > 1 for m in micro), micro  # more than one pass per minibatch
    wa, wb = weights(a), weights(b)
    diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
    # the same AdamW rounding-noise allowance as test_fsdp2_reaches_the_replica_parameters
    assert float(diff.max()) < 2e-4 and float(diff.mean()) < 1e-6
    assert float((diff > 1e-6).float().mean()) < 0.01
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        torch.testing.assert_close(torch.tensor(losses(b, key)), torch.tensor(losses(a, key)))
