"""train.backend=megatron: HF Qwen2 <-> megatron-core GPTModel conversion, TP=2 over gloo
equal to one process, and `mmyatt train` on the Megatron backend. Skipped (with the
reason) where megatron-core is not installed."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from test_cli import ROOT, TINY, mmyatt
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmyatt.engines import available
from mmyatt.engines.megatron_convert import hf_to_megatron, megatron_to_hf

needs_megatron = pytest.mark.skipif(
    not available("megatron"), reason="megatron-core not installed: pip install 'mmyatt[megatron]'"
)


def qwen2(tied: bool = True, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_exact(tp, tied):
    hf = qwen2(tied)
    sd = hf.state_dict()
    shards = [hf_to_megatron(sd, hf.config, tp, r) for r in range(tp)]
    back = megatron_to_hf(shards, hf.config)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # the grouped q/k/v layout: rank 0 holds query group 0 (its 2 q heads, then k, then v)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[:32], q[:32]) and torch.equal(qkv[32:48], k[:16])
    if tp == 2:  # SwiGLU fc1 on rank 1: [gate rows 64:128; up rows 64:128]
        fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:64], sd["model.layers.0.mlp.gate_proj.weight"][64:])


def test_tp_must_divide_the_heads():
    hf = qwen2()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_to_megatron(hf.state_dict(), hf.config, 4, 0)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :4] = 0  # a left-padded row
    return ids, attn


def _hf_loss(hf, ids, attn):
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    return _loss(logits, ids, attn)


def _loss(logits, ids, attn):
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = (attn[:, 1:] * attn[:, :-1]).bool()  # real token predicted from a real one
    return -(torch.where(keep, lp, 0.0).sum() / keep.sum())


def _tp_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as tdist

    from mmyatt.engines import megatron_model as M

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    hf = qwen2()
    M.init_parallel(world)
    model = M.build_gpt(hf.config, world)
    M.load_hf_weights(model, hf.state_dict(), hf.config)
    ids, attn = _batch()
    loss = _loss(M.forward_logits(model, ids, attn), ids, attn)
    loss.backward()
    # gradients of this rank's shard, joined over the TP group back into HF names
    grads = {k: p.grad for k, p in model.named_parameters()}
    import megatron.core.parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    shards = [dict() for _ in range(world)]
    for k, g in grads.items():
        parts = [torch.empty_like(g) for _ in range(world)]
        tdist.all_gather(parts, g.contiguous(), group=group)
        for r in range(world):
            shards[r][k] = parts[r]
    hf_grads = megatron_to_hf(shards, hf.config)
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": hf_grads}, out)
    tdist.barrier()
    tdist.destroy_process_group()


@needs_megatron
def test_tensor_parallel_2_equals_one_process(tmp_path):
    """TP=2 over two gloo processes: the loss and the (joined) gradients equal the HF
    model's in one process, to float tolerance."""
    from mmyatt.distributed import free_port

    out = str(tmp_path / "tp2.pt")
    mp.start_processes(
        _tp_rank, args=(2, free_port(), out), nprocs=2, start_method="spawn", join=True
    )
    got = torch.load(out, weights_only=True)
    hf = qwen2()
    ids, attn = _batch()
    loss = _hf_loss(hf, ids, attn)
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
    for k, p in hf.named_parameters():
        torch.testing.assert_close(got["grads"][k], p.grad, atol=1e-5, rtol=1e-4, msg=k)


@needs_megatron
def test_one_process_logits_and_round_trip_through_the_model():
    from mmyatt.engines import megatron_model as M

    hf = qwen2(tied=False)
    M.init_parallel(1)
    model = M.build_gpt(hf.config, 1)
    M.load_hf_weights(model, hf.state_dict(), hf.config)
    ids, attn = _batch()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    ref = hf(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    got = M.forward_logits(model, ids, attn)
    keep = attn.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=1e-5)
    back = M.gather_hf_weights(model, hf.config)
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    import megatron.core.parallel_state as ps
    import torch.distributed as tdist

    ps.destroy_model_parallel()  # leave no process group behind for later tests
    tdist.destroy_process_group()


@pytest.mark.slow  # two 2-controller runs
@needs_megatron
def test_train_on_megatron_matches_replica(tmp_path):
    """`mmyatt train train.backend=megatron` (2 controllers, Megatron TP=1 each): the
    exported HF weights and losses equal the replica backend's within tolerance."""
    (tmp_path / "lenreward.py").write_text(
        "def reward(completion, record):\n    return len(completion) / 10.0\n"
    )
    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    args = [
        *[a for a in TINY if not a.startswith("trainer.steps")],
        "trainer.steps=2",
        "distributed.nproc=2",
        "reward.functions=[{name: 'lenreward:reward'}]",
    ]
    a, b = tmp_path / "replica", tmp_path / "megatron"
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=replica", "--run-dir", str(a))
    mmyatt(tmp_path, "train", cfg, *args, "train.backend=megatron", "--run-dir", str(b))
    from safetensors.torch import load_file

    wa = load_file(str(a / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / "final" / "model.safetensors"))
    base = load_file(str(a / "base_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert any(not torch.equal(wa[k], base[k]) for k in wa)
    # As for FSDP2 (tests/test_engines_fsdp2.py): AdamW turns rounding-level gradient
    # differences into lr-sized steps on elements whose gradient is ~0. Measured: 0.3% of
    # elements differ by more than 1e-6, the largest by 1.7e-4, the mean by 4e-8, while
    # the weights moved by 1.4e-2 on average.
    diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
    move = torch.cat([(wa[k] - base[k]).abs().flatten() for k in wa])
    assert float(diff.max()) < 5e-4 and float(move.mean()) > 1e-2
    assert float((diff > 1e-6).float().mean()) < 0.01
    assert float(diff.mean()) < 1e-6

    def series(run, key):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return torch.tensor([r[key] for r in rows if key in r])

    torch.testing.assert_close(
        series(b, "train/loss"), series(a, "train/loss"), atol=1e-6, rtol=1e-5
    )
    ga, gb = series(a, "train/grad_norm"), series(b, "train/grad_norm")
    assert len(ga) == 2
    torch.testing.assert_close(gb, ga, atol=0, rtol=1e-5)


# ---------------------------------------------------------------------- pipeline parallel
def _microbatches():
    """Two microbatches of the test batch's shape (the schedule needs equal shapes)."""
    ids, attn = _batch()
    g = torch.Generator().manual_seed(2)
    ids2 = torch.randint(0, 320, (3, 12), generator=g)
    attn2 = torch.ones_like(ids2)
    attn2[2, :7] = 0
    return [{"ids": ids, "attn": attn}, {"ids": ids2, "attn": attn2}]


def _mb_loss(logits, batch):
    return _loss(logits, batch["ids"], batch["attn"])


def _pp_rank(rank: int, world: int, port: int, out: str, tied: bool, pp: int) -> None:
    import torch.distributed as tdist

    from mmyatt.engines import megatron_pp as PP

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    hf = qwen2(tied)
    PP.init_parallel(world // pp, pp)
    model = PP.build_stage(hf.config, world // pp, pp)
    PP.load_stage_weights(model, hf.state_dict(), hf.config)
    back = PP.join_stages(dict(model.named_parameters()), hf.config)  # weights round trip
    exact = all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    losses = PP.forward_backward(model, _microbatches(), _mb_loss)
    grads = PP.join_stages({k: p.grad for k, p in model.named_parameters()}, hf.config)
    if rank == world - 1:  # the last stage has the losses
        torch.save({"losses": torch.stack(losses), "grads": grads, "exact": exact}, out)
    tdist.barrier()
    tdist.destroy_process_group()


def _reference(tied: bool):
    """The HF model in one process: microbatch losses and the gradients of their mean."""
    hf = qwen2(tied)
    losses = [_hf_loss(hf, b["ids"], b["attn"]) for b in _microbatches()]
    torch.stack(losses).mean().backward()
    grads = {k: p.grad for k, p in hf.named_parameters()}
    if tied:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return torch.stack(losses).detach(), grads


def _run_pp(tmp_path, tied: bool, pp: int, world: int):
    from mmyatt.distributed import free_port

    out = str(tmp_path / f"pp{pp}_{world}_{tied}.pt")
    mp.start_processes(
        _pp_rank,
        args=(world, free_port(), out, tied, pp),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=True)


@needs_megatron
@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pipeline_parallel_2_equals_one_process(tmp_path, tied):
    """PP=2 over two gloo processes with megatron-core's 1F1B schedule
    (forward_backward_pipelining_without_interleaving), two microbatches: each
    microbatch loss and the joined gradients (tied embeddings summed over the first and
    last stage) equal the HF model's in one process; the stage weights join back to the
    HF state dict exactly."""
    got = _run_pp(tmp_path, tied, pp=2, world=2)
    assert got["exact"]
    losses, grads = _reference(tied)
    torch.testing.assert_close(got["losses"], losses, atol=1e-5, rtol=1e-5)
    assert set(got["grads"]) == set(grads)
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.slow  # one more 2-process run
@needs_megatron
def test_one_stage_schedule_equals_one_process(tmp_path):
    """The same through forward_backward_no_pipelining (PP=1, TP=2)."""
    got = _run_pp(tmp_path, True, pp=1, world=2)
    losses, grads = _reference(True)
    torch.testing.assert_close(got["losses"], losses, atol=1e-5, rtol=1e-5)
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, atol=1e-5, rtol=1e-4, msg=k)


# ------------------------------------------------------- a tensor-parallel group as one controller
def _tp_train_args(tmp_path, *extra):
    (tmp_path / "lenreward.py").write_text(
        "def reward(completion, record):\n    return len(completion) / 10.0\n"
    )
    return [
        *[a for a in TINY if not a.startswith("trainer.steps")],
        "train.backend=megatron",
        "reward.functions=[{name: 'lenreward:reward'}]",
        *extra,
    ]


def _series(run, key):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([r[key] for r in rows if key in r])


def _parallel_equals_one_process(tmp_path, flag: str):
    """3 steps of one process and of 2 processes with ``flag`` (one controller): same
    samples and rewards, losses and gradient norms within rounding, exported weights
    within the AdamW rounding allowance of the other engine tests; only the first rank
    writes into the run directory. Returns the two run directories."""
    args = _tp_train_args(tmp_path, "trainer.steps=3")
    a, b = tmp_path / "one", tmp_path / "two"
    cfg = str(ROOT / "configs" / "text_grpo_tiny.yaml")
    mmyatt(tmp_path, "train", cfg, *args, "distributed.nproc=1", "--run-dir", str(a))
    out = mmyatt(tmp_path, "train", cfg, *args, "distributed.nproc=2", flag, "--run-dir", str(b))
    assert "1 controller(s)" in out.stdout
    from safetensors.torch import load_file

    wa = load_file(str(a / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / "final" / "model.safetensors"))
    base = load_file(str(a / "base_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    diff = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
    move = torch.cat([(wa[k] - base[k]).abs().flatten() for k in wa])
    assert float(diff.max()) < 5e-4 and float(move.mean()) > 1e-2
    assert float((diff > 1e-6).float().mean()) < 0.01 and float(diff.mean()) < 1e-6
    # the rollouts are the one-process run's: rewards equal exactly
    ra, rb = _series(a, "reward/generated_mean"), _series(b, "reward/generated_mean")
    assert len(ra) == 3 and torch.equal(ra, rb)
    torch.testing.assert_close(
        _series(b, "train/loss"), _series(a, "train/loss"), atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        _series(b, "train/grad_norm"), _series(a, "train/grad_norm"), atol=0, rtol=1e-5
    )
    # the second rank wrote only into its private directory
    assert sorted(p.name for p in (b / "rollouts").iterdir()) == sorted(
        p.name for p in (a / "rollouts").iterdir()
    )
    return a, b


def resumes_exactly(tmp_path, *args) -> dict:
    """``mmyatt train *args`` (a config path first, checkpoint.save_every=2): 4 steps
    uninterrupted and 2 steps + a resume to 4 give the same run-state checkpoint, the
    same exported weights and the same losses, bit for bit. Returns the checkpoint's
    tensors (for the caller's checks of what it holds)."""
    from safetensors.torch import load_file
    from test_resume import stop_and_resume

    full, parts, _ = stop_and_resume(tmp_path, *args)
    sa = load_file(str(sorted(full.rglob("shared.safetensors"))[-1]))
    sb = load_file(str(sorted(parts.rglob("shared.safetensors"))[-1]))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    wa = load_file(str(full / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(parts / "checkpoints" / "final" / "model.safetensors"))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert torch.equal(_series(full, "train/loss"), _series(parts, "train/loss"))
    return sa


@pytest.mark.slow  # a 1-process and a 2-process run
@needs_megatron
def test_train_tensor_parallel_2_equals_tensor_parallel_1(tmp_path):
    """`mmyatt train` with train.tensor_parallel=2 on 2 processes (one controller: the
    group's first rank generates, both run the loss on their shards) equals the
    one-process TP=1 run: same samples and rewards, losses and gradient norms within
    rounding, exported weights within the AdamW rounding allowance of the other
    engine tests; only the first rank writes into the run directory."""
    _parallel_equals_one_process(tmp_path, "train.tensor_parallel=2")


@pytest.mark.slow  # three 2-process runs
@needs_megatron
def test_train_tensor_parallel_2_resumes_exactly(tmp_path):
    """Checkpoints of a TP=2 controller hold whole HF-named weights and AdamW moments;
    4 steps uninterrupted = 2 steps + resume to 4, bit for bit."""
    args = _tp_train_args(
        tmp_path, "distributed.nproc=2", "train.tensor_parallel=2", "checkpoint.save_every=2"
    )
    sa = resumes_exactly(tmp_path, str(ROOT / "configs" / "text_grpo_tiny.yaml"), *args)
    assert any("exp_avg_sq" in k for k in sa)


# ------------------------------------------------------- a pipeline-parallel group as one controller
@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.pipeline_parallel=2"], "multiple of it"),
        (
            ["train.pipeline_parallel=2", "train.tensor_parallel=2", "distributed.nproc=2"],
            "multiple of it",
        ),
        (
            ["train.pipeline_parallel=2", "distributed.nproc=2", "placement.balance=true"],
            "placement.balance",
        ),
        (["train.pipeline_parallel=0"], "must be >= 1"),
    ],
)
def test_pipeline_parallel_config_errors(overrides, match):
    """Checked before megatron's import: these fail the same way without it installed."""
    from mmyatt.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["train.backend=megatron", *overrides])


@pytest.mark.slow  # a 1-process and a 2-process run
@needs_megatron
def test_train_pipeline_parallel_2_equals_pipeline_parallel_1(tmp_path):
    """`mmyatt train` with train.pipeline_parallel=2 on 2 processes (one controller: the
    first stage's process generates, the update runs through megatron-core's 1F1B
    schedule with the loss on the last stage) equals the one-process run: same rollouts
    and rewards, losses and gradient norms within rounding, exported weights within the
    allowance of the TP test; only the first rank writes into the run directory."""
    _, b = _parallel_equals_one_process(tmp_path, "train.pipeline_parallel=2")
    assert not list((b / ".mirror").rglob("*.safetensors"))  # the second stage wrote no state


@pytest.mark.slow  # three 2-process runs
@needs_megatron
def test_train_pipeline_parallel_2_resumes_exactly(tmp_path):
    """Checkpoints of a PP=2 controller hold every stage's weights and AdamW moments whole
    and HF-named; 4 steps uninterrupted = 2 steps + resume to 4, bit for bit."""
    args = _tp_train_args(
        tmp_path, "distributed.nproc=2", "train.pipeline_parallel=2", "checkpoint.save_every=2"
    )
    sa = resumes_exactly(tmp_path, str(ROOT / "configs" / "text_grpo_tiny.yaml"), *args)
    # moments of the first and the last stage's layers are both there
    layers = {
        k.split("layers.")[1].split(".")[0] for k in sa if "exp_avg_sq" in k and "layers." in k
    }
    assert len(layers) >= 2, sorted(sa)[:20]
