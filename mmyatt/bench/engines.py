"""`mmyatt bench engines`: rollout and update engines side by side, in one process.

For a text policy (Qwen2.5 0.5B / 1.5B: the real configs with random weights on a GPU;
a tiny Qwen2 on the CPU) it measures, per arm:

- rollout tokens/s of the adapter's own sampler (``rollout.backend=hf``) and of vLLM
  (``rollout.backend=vllm``, when installed), and their ratio;
- the update of ``train.backend=replica`` and ``fsdp2``: seconds per optimizer step
  (one forward + backward over the rollout + AdamW) and, on CUDA, MFU =
  6 x parameters x processed tokens / time / peak bf16 FLOP/s (989 TFLOP/s for H100/H200
  SXM; the 6N rule counts no attention FLOPs, so it slightly under-states);
- vLLM weight-sync seconds (trainer -> engine after the update) and sleep / wake seconds;
- peak device memory (CUDA) or peak RSS (CPU).

And a VLM step with images (Qwen2-VL shaped: 2B-like on a GPU, tiny on the CPU): HF
rollout + FSDP2 update, with the same timings. Every figure is measured here; arms that
cannot run (vLLM not installed, no CUDA for MFU) are reported as skipped with the reason.
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmyatt import algorithms as alg
from mmyatt.bench.runs import machine
from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.engines import available, build_engines, close_engines
from mmyatt.models.builtin import tiny_vlm
from mmyatt.models.builtin.tokenizer import train_bpe_tokenizer
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import RolloutStats, Sampling

PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM dense bf16

# the Qwen2.5 text configs (vocabulary, layers, widths as published), random weights
QWEN25 = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # head_dim 64: vLLM's CPU attention has no kernel below 32
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=320,
        tie_word_embeddings=True,
    ),
}
# Qwen2-VL-2B's language model and vision tower widths (random weights, small vocabulary)
VLM_2B = dict(
    text=dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
    ),
    vision=dict(depth=32, embed_dim=1280, num_heads=16),
)

CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(40) for b in range(20)]


def build_text_model(out: Path, size: str, dtype: torch.dtype) -> Path:
    """A Qwen2 directory with ``size``'s config, random weights and a local tokenizer
    (no downloads; ids past the tokenizer are never sampled)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = train_bpe_tokenizer(CORPUS, out, vocab_size=320)
    cfg = Qwen2Config(
        **QWEN25[size],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(out))
    return out


def _records(n: int) -> list[dict]:
    return [{"prompt": CORPUS[i % len(CORPUS)][:24], "_index": i} for i in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(
    policy_factory,
    overrides,
    *,
    prompts,
    group,
    tokens,
    steps,
    device,
    records=_records,
    micro_batch: int = 16,
):
    """``steps`` GRPO-shaped steps (generate, score-free random advantages, one update
    accumulated over micro-batches of ``micro_batch`` sequences) through
    ``build_engines``; medians over the steps after the first (warm-up)."""

    cfg = load_config(None, overrides)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    engine, policy = build_engines(cfg, Dist(0, 1, device), policy_factory())
    params = [p for p in policy.module().parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    gen_s, upd_s, tok_gen, tok_proc, syncs = [], [], [], [], []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        recs = records(prompts)
        _sync(device)
        t0 = time.perf_counter()
        r = policy.generate(recs, group, Sampling(max_new_tokens=tokens), list(range(prompts)))
        _sync(device)
        t1 = time.perf_counter()
        adv = torch.randn(len(r), generator=g)
        opt.zero_grad(set_to_none=True)
        # micro-batches of ``micro_batch`` sequences, each numerator over the batch's
        # token count (token-mean): the gradient of the whole batch's loss, without the
        # whole batch's logits at once (16 x 8 x 288 tokens x 152 k vocab is 18 GB in fp32)
        den = r.mask.sum().clamp(min=1).to(device)
        for lo in range(0, len(r), micro_batch):
            rows = list(range(lo, min(lo + micro_batch, len(r))))
            mb = r.select(rows)
            lp = policy.logprobs(mb)
            mask = mb.mask.to(lp.device)
            old = mb.logprobs.to(lp.device)
            loss_mat, _ = alg.ppo_clip_loss(lp, old, adv[rows].to(lp.device), mask)
            num, _ = alg.loss_terms(loss_mat, mask, "token-mean", max_len=r.num_actions)
            (num / den).backward()
        engine.reduce_and_clip(params, 1.0)
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        if step == 0:
            continue
        gen_s.append(t1 - t0)
        upd_s.append(t2 - t1)
        tok_gen.append(float(r.mask.sum()))
        tok_proc.append(float(r.context["input_ids"].numel()))
        if isinstance(policy, RolloutStats):  # a vLLM rollout engine: its weight-sync time
            syncs.append(dict(policy.timings))
    gen, upd = statistics.median(gen_s), statistics.median(upd_s)
    out = {
        "overrides": overrides,
        "trainable_params": n_params,
        "rollout_s": gen,
        "rollout_tokens_per_s": statistics.median(tok_gen) / gen,
        "update_s": upd,
        "update_tokens_per_s": statistics.median(tok_proc) / upd,
        "peak_memory_mb": _peak_mb(device),
    }
    if device.startswith("cuda"):
        out["update_mfu"] = 6 * n_params * statistics.median(tok_proc) / upd / PEAK_BF16_FLOPS
    for k in ("rollout/weight_sync_s", "rollout/sleep_s", "rollout/wake_s"):
        vals = [s[k] for s in syncs if k in s]
        if vals:
            out[k.split("/")[1]] = statistics.median(vals)
    import torch.distributed as tdist

    close_engines()  # a vLLM engine leaves before the process group it uses
    if tdist.is_initialized():  # the FSDP2 arm made a process group of one
        tdist.destroy_process_group()
    return out


def bench_engines(quick: bool = False, size: str | None = None) -> dict:

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    size = size or ("qwen2.5-0.5b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    prompts, group, tokens = (16, 8, 256) if cuda else (4, 4, 8)
    if quick:
        prompts, tokens = max(2, prompts // 4), max(4, tokens // 4)
    steps = 3
    out: dict = {
        "benchmark": "engines",
        "machine": machine(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": size,
        "prompts": prompts,
        "group_size": group,
        "max_new_tokens": tokens,
        "steps_measured": steps - 1,
        "arms": {},
        "skipped": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = build_text_model(Path(tmp) / "model", size, dtype)

        def make():
            return TextPolicy.load(path, dtype=dtype, max_prompt_tokens=32, device=device)

        arms = {
            "hf_replica": ["train.backend=replica"],
            "hf_fsdp2": ["train.backend=fsdp2"],
            "vllm_fsdp2": ["train.backend=fsdp2", "rollout.backend=vllm", f"model.path={path}"],
        }
        for name, ov in arms.items():
            if "rollout.backend=vllm" in ov and not available("vllm"):
                out["skipped"][name] = "vllm not installed"
                continue
            try:
                out["arms"][name] = run_arm(
                    make,
                    ov,
                    prompts=prompts,
                    group=group,
                    tokens=tokens,
                    steps=steps,
                    device=device,
                )
            except Exception as e:  # an arm that fails is reported, the others still run
                out["skipped"][name] = f"{type(e).__name__}: {e}"[:500]
        a = out["arms"]
        if "hf_replica" in a and "hf_fsdp2" in a:
            out["update_speed_fsdp2_over_replica"] = (
                a["hf_replica"]["update_s"] / a["hf_fsdp2"]["update_s"]
            )
        if "vllm_fsdp2" in a and "hf_fsdp2" in a:
            out["rollout_speed_vllm_over_hf"] = (
                a["vllm_fsdp2"]["rollout_tokens_per_s"] / a["hf_fsdp2"]["rollout_tokens_per_s"]
            )
        try:
            out["vlm_fsdp2"] = bench_vlm(Path(tmp) / "vlm", cuda, device, quick)
        except Exception as e:
            out["skipped"]["vlm_fsdp2"] = f"{type(e).__name__}: {e}"[:500]
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def bench_vlm(out: Path, cuda: bool, device: str, quick: bool) -> dict:
    """A VLM GRPO-shaped step with images: HF rollout + FSDP2 update."""
    from PIL import Image

    size = "small"
    if cuda:  # a 2B-shaped Qwen2-VL (this module's own size entry)
        tiny_vlm.TINY_VLM_SIZES.setdefault("bench-2b", VLM_2B)
        size = "bench-2b"
    path = tiny_vlm.build_tiny_vlm(out, size=size, corpus=CORPUS[:50])
    dtype = torch.bfloat16 if cuda else torch.float32

    def make():
        return VLMPolicy.load(path, dtype=dtype, max_prompt_tokens=48, device=device)

    images = [Image.new("RGB", (56, 56), c) for c in ("red", "blue", "green", "yellow")]

    def vlm_records(n):
        return [
            {"prompt": "What colour is the shape?", "image": images[i % 4], "_index": i}
            for i in range(n)
        ]

    return run_arm(
        make,
        ["train.backend=fsdp2", "model.kind=vlm"],
        prompts=16 if cuda and not quick else 4,
        group=4,
        tokens=64 if cuda else 8,
        steps=3,
        device=device,
        records=vlm_records,
    )
