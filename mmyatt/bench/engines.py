"""`mmyatt bench engines`: rollout and update engines side by side, in one process.

For a text policy (Qwen2.5 0.5B / 1.5B: the real configs with random weights on a GPU;
a tiny Qwen2 on the CPU) it measures, per arm:

- rollout tokens/s of the adapter's own sampler (``rollout.backend=hf``) and of vLLM
  (``rollout.backend=vllm``, when installed), and their ratio;
- the update of ``train.backend=replica`` and ``fsdp2``: seconds per optimizer step
  (one forward + backward over the rollout + AdamW, in micro-batches of a token budget);
- model FLOP/s per phase (rollout, update) from the model's FLOPs per token
  (``mmyatt.step.flops``: 2N per token fed plus attention, training three times that; real
  tokens, each prompt once per group) and, on a GPU with a known peak, MFU per phase;
  ``update_mfu_6n_padded`` is the former 6 x parameters x padded tokens figure;
- vLLM weight-sync seconds (trainer -> engine after the update) and sleep / wake seconds;
- peak device memory (CUDA) or peak RSS (CPU).

And a VLM step with images (Qwen2-VL shaped: 2B-like on a GPU, tiny on the CPU): HF
rollout + FSDP2 update, with the same timings. Every figure is measured here; arms that
cannot run (vLLM not installed, no CUDA for MFU) are reported as skipped with the reason.

``decode=True`` (``python -m mmyatt.bench.engines --decode``) compares the HF decode
paths instead, same shapes, one run: the default steps, the fixed-shape steps over a kept
cache (``rollout.hf_static_cache``) and those compiled (``rollout.compile_decode``: CUDA
graphs on a GPU), for the text policy and the VLM (replica engine), with the ratios of
their rollout tokens/s and how many rows draw the very same tokens as the default path.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from mmyatt import algorithms as alg
from mmyatt.bench.registry import write_result
from mmyatt.bench.runs import machine
from mmyatt.config.schema import load_config
from mmyatt.distributed import Dist
from mmyatt.engines import available, build_engines, close_engines
from mmyatt.models.builtin import tiny_vlm
from mmyatt.models.builtin.tokenizer import train_bpe_tokenizer
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import RolloutStats, Sampling
from mmyatt.rollout import Rollout
from mmyatt.step.batches import token_micro_batches
from mmyatt.step.flops import ModelFlops, mfu, rollout_flops
from mmyatt.step.perf import device_peak

FAST = ["rollout.hf_static_cache=true"]
COMPILED = [*FAST, "rollout.compile_decode=true"]

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


def _agreement(default: Rollout, fast: Rollout) -> dict:
    """How many rows drew the very same tokens, and the largest log-prob gap where they
    did (the default decode path against the fixed-shape one, same seeds)."""
    same = (default.actions == fast.actions).all(1) & (default.mask == fast.mask).all(1)
    gap = (default.logprobs - fast.logprobs).abs().amax(1)
    return {
        "rows_same_tokens": float(same.float().mean()),
        "max_logprob_gap_same_rows": float(gap[same].max()) if bool(same.any()) else None,
    }


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
    micro_batch_tokens: int = 16 * (32 + 256),
    language_model=None,
    compile_backend: str | None = None,
):
    """``steps`` GRPO-shaped steps (generate, score-free random advantages, one update
    accumulated over micro-batches of at most ``micro_batch_tokens`` padded tokens,
    ``mmyatt.step.batches.token_micro_batches``) through ``build_engines``; medians over
    the steps after the first (warm-up, and the compile of a compiled decode step:
    ``rollout_first_s``). With ``rollout.hf_static_cache`` in ``overrides``, the first
    rollout is drawn again through the default decode path to compare the samples.
    ``language_model(module)``: the part whose FLOPs count (a VLM's language model)."""

    cfg = load_config(None, overrides)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    raw = policy_factory()
    module = raw.module()
    flops = ModelFlops.of(module, language_model(module) if language_model else None)
    engine, policy = build_engines(cfg, Dist(0, 1, device), raw)
    if compile_backend is not None and cfg.rollout.compile_decode:
        raw.fast_decode.backend = compile_backend
    params = [p for p in policy.module().parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    gen_s, upd_s, tok_gen, tok_proc, syncs, f_gen, f_upd = [], [], [], [], [], [], []
    first_s, agreement = None, None
    g = torch.Generator().manual_seed(0)
    sampling = Sampling(max_new_tokens=tokens)
    for step in range(steps):
        recs = records(prompts)
        _sync(device)
        t0 = time.perf_counter()
        r = policy.generate(recs, group, sampling, list(range(prompts)))
        _sync(device)
        t1 = time.perf_counter()
        if step == 0 and cfg.rollout.hf_static_cache:
            fast, raw.fast_decode = raw.fast_decode, None  # the default path, once
            agreement = _agreement(raw.generate(recs, group, sampling, list(range(prompts))), r)
            raw.fast_decode = fast  # (not timed: the update's clock starts below)
        adv = torch.randn(len(r), generator=g)
        opt.zero_grad(set_to_none=True)
        # micro-batches by padded tokens, each numerator over the batch's token count
        # (token-mean): the gradient of the whole batch's loss, without the whole batch
        # at once (16 x 8 x 288 tokens x 152 k vocabulary is 11 GB of bf16 logits)
        den = r.mask.sum().clamp(min=1).to(device)
        t1u = time.perf_counter()
        for rows in token_micro_batches(r, micro_batch_tokens, whole_groups=True):
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
            first_s = t1 - t0
            continue
        gen_s.append(t1 - t0)
        upd_s.append(t2 - t1u)
        tok_gen.append(float(r.mask.sum()))
        tok_proc.append(float(r.context["input_ids"].numel()))
        fg, fu = rollout_flops(r, flops)
        f_gen.append(fg)
        f_upd.append(fu)
        if isinstance(policy, RolloutStats):  # a vLLM rollout engine: its weight-sync time
            syncs.append(dict(policy.timings))
    gen, upd = statistics.median(gen_s), statistics.median(upd_s)
    fg, fu = statistics.median(f_gen), statistics.median(f_upd)
    out = {
        "overrides": overrides,
        "trainable_params": n_params,
        "model_flops": {
            "matmul_params": flops.matmul_params,
            "layers": flops.layers,
            "attn_width": flops.attn_width,
        },  # fmt: skip
        "rollout_first_s": first_s,
        "rollout_s": gen,
        "rollout_tokens_per_s": statistics.median(tok_gen) / gen,
        "rollout_tflops_per_s": fg / gen / 1e12,
        "update_s": upd,
        "update_tokens_per_s": statistics.median(tok_proc) / upd,
        "update_tflops_per_s": fu / upd / 1e12,
        "micro_batch_tokens": micro_batch_tokens,
        "peak_memory_mb": _peak_mb(device),
    }
    peak = device_peak(torch.device(device))
    if peak is not None:
        out["rollout_mfu"] = mfu(fg, gen, peak)
        out["update_mfu"] = mfu(fu, upd, peak)
        out["update_mfu_6n_padded"] = 6 * n_params * statistics.median(tok_proc) / upd / peak
    if agreement is not None:
        out["same_samples_as_default"] = agreement
    for k in ("rollout/weight_sync_s", "rollout/sleep_s", "rollout/wake_s"):
        vals = [s[k] for s in syncs if k in s]
        if vals:
            out[k.split("/")[1]] = statistics.median(vals)
    close_engines()  # a vLLM engine leaves before the process group it uses
    if tdist.is_initialized():  # the FSDP2 arm made a process group of one
        tdist.destroy_process_group()
    return out


def _shapes(cuda: bool, quick: bool, tokens: int | None) -> tuple[int, int, int]:
    prompts, group, budget = (16, 8, 256) if cuda else (4, 4, 8)
    if quick:
        prompts, budget = max(2, prompts // 4), max(4, budget // 4)
    return prompts, group, tokens or budget


def bench_engines(
    quick: bool = False,
    size: str | None = None,
    decode: bool = False,
    tokens: int | None = None,
    compile_backend: str | None = None,
    on_arm=None,
    steps: int = 3,
    micro_batch_tokens: int | None = None,
) -> dict:
    """The engines' arms (module docstring); ``decode``: the HF decode paths instead.
    ``tokens``: the action budget, the VLM's too (default by device); ``steps``: per arm,
    the first a warm-up, medians over the rest; ``micro_batch_tokens``: the text arms'
    update budget (default 16 x (32 + tokens): 16 sequences); ``compile_backend``: the
    compiled decode arms' torch.compile backend (default inductor; "eager" checks the
    capture alone, without a compiler's minutes on the CPU). ``on_arm(result)``: called
    with the result so far after each arm (a caller under a time limit writes it)."""
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    size = size or ("qwen2.5-0.5b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    vlm_tokens = tokens  # the VLM's own default unless asked
    prompts, group, tokens = _shapes(cuda, quick, tokens)
    out: dict = {
        "benchmark": "engines-decode" if decode else "engines",
        "machine": machine(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": size,
        "prompts": prompts,
        "group_size": group,
        "max_new_tokens": tokens,
        "steps_measured": steps - 1,
        "compile_backend": compile_backend or "inductor",
        "arms": {},
        "skipped": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = build_text_model(Path(tmp) / "model", size, dtype)

        def make():
            return TextPolicy.load(path, dtype=dtype, max_prompt_tokens=32, device=device)

        if decode:
            arms = {
                "hf_replica": ["train.backend=replica"],
                "hf_replica_compiled": ["train.backend=replica", *COMPILED],
                "hf_replica_static": ["train.backend=replica", *FAST],
            }
        else:
            arms = {
                "hf_replica": ["train.backend=replica"],
                "hf_fsdp2": ["train.backend=fsdp2"],
                "vllm_fsdp2": [
                    "train.backend=fsdp2",
                    "rollout.backend=vllm",
                    f"model.path={path}",
                ],
            }
        kw = dict(prompts=prompts, group=group, tokens=tokens, steps=steps, device=device)
        kw["micro_batch_tokens"] = micro_batch_tokens or 16 * (32 + tokens)
        kw["compile_backend"] = compile_backend
        for name, ov in arms.items():
            if "rollout.backend=vllm" in ov and not available("vllm"):
                out["skipped"][name] = "vllm not installed"
                continue
            try:
                out["arms"][name] = run_arm(make, ov, **kw)
            except Exception as e:  # an arm that fails is reported, the others still run
                out["skipped"][name] = f"{type(e).__name__}: {e}"[:500]
            if on_arm is not None:
                on_arm(out)
        a = out["arms"]
        if "hf_replica" in a and "hf_fsdp2" in a:
            out["update_speed_fsdp2_over_replica"] = (
                a["hf_replica"]["update_s"] / a["hf_fsdp2"]["update_s"]
            )
        if "vllm_fsdp2" in a and "hf_fsdp2" in a:
            out["rollout_speed_vllm_over_hf"] = (
                a["vllm_fsdp2"]["rollout_tokens_per_s"] / a["hf_fsdp2"]["rollout_tokens_per_s"]
            )
        if decode:
            out["vlm_arms"] = {}
            for name, ov in (("default", []), ("compiled", COMPILED), ("static", FAST)):
                try:
                    out["vlm_arms"][f"vlm_replica_{name}"] = bench_vlm(
                        Path(tmp) / "vlm",
                        cuda,
                        device,
                        quick,
                        ["train.backend=replica", *ov],
                        compile_backend=compile_backend,
                        tokens=vlm_tokens,
                        steps=steps,
                    )
                except Exception as e:
                    out["skipped"][f"vlm_replica_{name}"] = f"{type(e).__name__}: {e}"[:500]
                if on_arm is not None:
                    on_arm(out)
            out["rollout_speed_over_default"] = _speedups(a, out["vlm_arms"])
        else:
            try:
                out["vlm_fsdp2"] = bench_vlm(
                    Path(tmp) / "vlm", cuda, device, quick, tokens=vlm_tokens, steps=steps
                )
            except Exception as e:
                out["skipped"]["vlm_fsdp2"] = f"{type(e).__name__}: {e}"[:500]
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _speedups(text: dict, vlm: dict) -> dict:
    """Rollout tokens/s of each fast decode arm over the default path, text and VLM."""
    out = {}
    for arms, base_arm, prefix in (
        (text, "hf_replica", "text"),
        (vlm, "vlm_replica_default", "vlm"),
    ):
        for name in ("static", "compiled"):
            fast = next((a for k, a in arms.items() if k.endswith(name)), None)
            if fast is not None and base_arm in arms:
                base = arms[base_arm]["rollout_tokens_per_s"]
                out[f"{prefix}_{name}"] = fast["rollout_tokens_per_s"] / base
    return out


def bench_vlm(
    out: Path,
    cuda: bool,
    device: str,
    quick: bool,
    overrides=None,
    compile_backend=None,
    tokens: int | None = None,
    steps: int = 3,
) -> dict:
    """A VLM GRPO-shaped step with images: HF rollout + an update (FSDP2 by default)."""
    from PIL import Image

    size = "small"
    if cuda:  # a 2B-shaped Qwen2-VL (this module's own size entry)
        tiny_vlm.TINY_VLM_SIZES.setdefault("bench-2b", VLM_2B)
        size = "bench-2b"
    if not (out / "config.json").is_file():
        tiny_vlm.build_tiny_vlm(out, size=size, corpus=CORPUS[:50])
    dtype = torch.bfloat16 if cuda else torch.float32

    def make():
        return VLMPolicy.load(out, dtype=dtype, max_prompt_tokens=48, device=device)

    images = [Image.new("RGB", (56, 56), c) for c in ("red", "blue", "green", "yellow")]

    def vlm_records(n):
        return [
            {"prompt": "What colour is the shape?", "image": images[i % 4], "_index": i}
            for i in range(n)
        ]

    tokens = tokens or (64 if cuda else 8)
    return run_arm(
        make,
        [*(overrides or ["train.backend=fsdp2"]), "model.kind=vlm"],
        prompts=16 if cuda and not quick else 4,
        group=4,
        tokens=tokens,
        steps=steps,
        device=device,
        records=vlm_records,
        micro_batch_tokens=16 * (48 + tokens),
        language_model=lambda m: m.model.language_model,
        compile_backend=compile_backend,
    )


def main(argv=None) -> int:
    """``python -m mmyatt.bench.engines [--quick] [--decode] --out FILE``."""
    ap = argparse.ArgumentParser(description="mmyatt bench engines (or its decode arms)")
    ap.add_argument("--quick", action="store_true", help="the small shapes the tests use")
    ap.add_argument("--decode", action="store_true", help="the HF decode paths side by side")
    ap.add_argument("--tokens", type=int, help="action budget per sample")
    ap.add_argument("--steps", type=int, default=3, help="per arm, the first a warm-up")
    ap.add_argument("--micro-batch-tokens", type=int, help="the text arms' update budget")
    ap.add_argument("--compile-backend", help="torch.compile backend of the compiled arms")
    ap.add_argument("--out", help="write the result (JSON) here")
    a = ap.parse_args(argv)
    partial = Path(f"{a.out}.partial") if a.out else None

    def on_arm(result: dict) -> None:  # what is measured so far, should time run out
        if partial is not None:
            write_result(result, partial)

    result = bench_engines(
        quick=a.quick,
        decode=a.decode,
        tokens=a.tokens,
        compile_backend=a.compile_backend,
        on_arm=on_arm,
        steps=a.steps,
        micro_batch_tokens=a.micro_batch_tokens,
    )
    if a.out:
        write_result(result, a.out)
        partial.unlink(missing_ok=True)
    else:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
