"""Peak memory of scoring the taken tokens (forward + backward of their log-probs and
entropies) from (N, L, V) logits: the full float32 computation the adapters made
before (``decode.temper`` + ``chosen_logprob`` + ``entropy``) against the chunked one
(``models.logprobs.token_logprobs``), each arm in a fresh process.

Peak above the inputs: on CUDA ``max_memory_allocated`` less what was allocated before
the arm; on the CPU the peak resident set (``ru_maxrss``) less the resident set before
the arm (large blocks are mapped and unmapped, so the resident set follows what is
live). Run from the repository root:

    python bench/logprob_memory.py --rows 8 --tokens 256 --vocab 32000 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from mmyatt.models import decode
from mmyatt.models.logprobs import token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_arm(arm: str, rows: int, tokens: int, vocab: int, dtype: str, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, tokens, vocab, generator=g).to(DTYPES[dtype]).to(device)
    logits.requires_grad_(True)
    taken = torch.randint(0, vocab, (rows, tokens), generator=g).to(device)
    banned = torch.tensor([vocab - 1])
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mb()
    t0 = time.perf_counter()
    if arm == "full":
        z = decode.temper(logits, 0.9, banned)
        lp, ent = decode.chosen_logprob(z, taken), decode.entropy(z)
    else:
        lp, ent = token_logprobs(logits, taken, 0.9, banned, with_entropy=True)
    (lp.sum() - 1e-3 * ent.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "arm": arm,
        "peak_above_inputs_mb": peak - before,
        "seconds": time.perf_counter() - t0,
        "logits_mb": logits.numel() * logits.element_size() / 2**20,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arm", choices=["full", "chunked"], help="run one arm here")
    ap.add_argument("--out", help="JSON file for both arms")
    a = ap.parse_args(argv)
    shape = dict(rows=a.rows, tokens=a.tokens, vocab=a.vocab, dtype=a.dtype, device=a.device)
    if a.arm:
        print(json.dumps(run_arm(a.arm, **shape)))
        return 0
    result = {"benchmark": "logprob_memory", **shape, "arms": {}}
    for arm in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--arm", arm]
        cmd += [f"--{k}={v}" for k, v in shape.items()]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            result["arms"][arm] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        result["arms"][arm] = json.loads(done.stdout.strip().splitlines()[-1])
    full, chunked = result["arms"]["full"], result["arms"]["chunked"]
    if "error" not in full and "error" not in chunked:
        result["peak_full_over_chunked"] = (
            full["peak_above_inputs_mb"] / chunked["peak_above_inputs_mb"]
        )
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
