"""Rollout tokens/s of the HF decode paths (default, fixed-shape, compiled) on one policy,
in interleaved rounds: each round runs every path once, so a machine whose load drifts
weighs on them alike (``python -m mmyatt.bench.engines --decode`` runs each path as
its own arm, one after another, with an update between rollouts). Rollouts only; the
models of the engines bench (tiny Qwen2 text, "small" Qwen2-VL on the CPU). Run from
the repository root:

    python bench/decode_rounds.py --policy text --tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from mmyatt.bench.engines import CORPUS, _records, build_text_model
from mmyatt.models.builtin import tiny_vlm
from mmyatt.models.text import TextPolicy
from mmyatt.models.vlm import VLMPolicy
from mmyatt.protocols import Sampling

PATHS = {"default": (False, False), "static": (True, False), "compiled": (True, True)}


def _policy(kind: str, tmp: Path):
    if kind == "text":
        path = build_text_model(tmp / "text", "tiny", torch.float32)
        return TextPolicy.load(path, max_prompt_tokens=32), _records
    path = tiny_vlm.build_tiny_vlm(tmp / "vlm", size="small", corpus=CORPUS[:50])
    images = [Image.new("RGB", (56, 56), c) for c in ("red", "blue", "green", "yellow")]

    def records(n):
        return [
            {"prompt": "What colour is the shape?", "image": images[i % 4], "_index": i}
            for i in range(n)
        ]

    return VLMPolicy.load(path, max_prompt_tokens=48), records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=["text", "vlm"], default="text")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    sampling = Sampling(max_new_tokens=a.tokens)
    seeds = list(range(a.prompts))
    with tempfile.TemporaryDirectory() as tmp:
        policy, records = _policy(a.policy, Path(tmp))
        recs = records(a.prompts)
        decoders, first, seconds, tokens = {}, {}, {p: [] for p in PATHS}, {}
        for name, (static, compiled) in PATHS.items():  # first rollouts: the compiles
            policy.set_decode(static, compiled)
            decoders[name] = policy.fast_decode
            t0 = time.perf_counter()
            policy.generate(recs, a.group, sampling, seeds)
            first[name] = time.perf_counter() - t0
        for _ in range(a.rounds):
            for name in PATHS:
                policy.fast_decode = decoders[name]
                t0 = time.perf_counter()
                r = policy.generate(recs, a.group, sampling, seeds)
                seconds[name].append(time.perf_counter() - t0)
                tokens[name] = float(r.mask.sum())
    out = {"policy": a.policy, "prompts": a.prompts, "group": a.group, "tokens": a.tokens}
    out["rounds"] = a.rounds
    for name in PATHS:
        med = statistics.median(seconds[name])
        out[name] = {
            "first_s": first[name],
            "median_s": med,
            "min_s": min(seconds[name]),
            "max_s": max(seconds[name]),
            "tokens_per_s": tokens[name] / med,
        }
    for name in ("static", "compiled"):
        out[f"{name}_over_default"] = out[name]["tokens_per_s"] / out["default"]["tokens_per_s"]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
