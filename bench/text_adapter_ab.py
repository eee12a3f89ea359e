"""The text adapter at an earlier git revision against the current one, in one process.

Same tiny model weights and workload as ``mmyatt bench text-grpo`` (16 prompts x 8
samples x 16 new tokens): per arm, generate under no_grad, then log-probs with entropy,
a policy-gradient loss, backward and an AdamW step. The arms alternate step by step;
medians over the steps after the first. The old adapter is read with ``git show
REV:models/text.py`` into a temporary module.

    flock /tmp/mmyatt-heavy.lock .venv/bin/python bench/text_adapter_ab.py --rev 3c252ae \
        --threads 1 --out bench/trl/text_adapter_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def old_adapter(rev: str, tmp: Path):
    src = subprocess.run(
        ["git", "show", f"{rev}:models/text.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    src = src.replace("from .protocol import", "from mmyatt.protocols import")
    src = src.replace("from . import decode", "from mmyatt.models import decode")
    path = tmp / "text_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("text_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TextPolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from mmyatt.config.schema import load_config
    from mmyatt.protocols import Sampling
    from mmyatt.models.text import TextPolicy
    from mmyatt.step.run import prepare_run, quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = load_config(str(ROOT / "configs" / "bench_text_grpo.yaml"), [])
        cfg = prepare_run(cfg, tmp / "prepared", log=lambda *x, **k: None)
        recs = [json.loads(x) for x in Path(cfg.data.train).read_text().splitlines() if x]
        classes = {"before": old_adapter(a.rev, tmp), "now": TextPolicy}
        pols = {k: c.load(cfg.model.path, max_prompt_tokens=8) for k, c in classes.items()}
        opts = {k: torch.optim.AdamW(p.model.parameters(), lr=1e-4) for k, p in pols.items()}
        s = Sampling(temperature=1.0, max_new_tokens=16)

        def step(k: str, i: int) -> tuple[float, float]:
            p = pols[k]
            batch = [dict(r, _index=16 * i + j) for j, r in enumerate(recs[16 * i : 16 * i + 16])]
            t0 = time.perf_counter()
            with torch.no_grad():
                r = p.generate(batch, 8, s, list(range(16 * i, 16 * i + 16)))
            t1 = time.perf_counter()
            lp, ent = p.logprobs(r, with_entropy=True)
            adv = torch.randn(len(r), generator=torch.Generator().manual_seed(i))[:, None]
            loss = -(lp * adv * r.mask).sum() / r.mask.sum() - 1e-3 * (ent * r.mask).sum()
            opts[k].zero_grad()
            loss.backward()
            opts[k].step()
            return t1 - t0, time.perf_counter() - t1

        times: dict[str, list] = {k: [] for k in pols}
        for i in range(a.steps):
            for k in ("now", "before") if i % 2 else ("before", "now"):
                times[k].append(step(k, i))
    out: dict = {"rev_before": a.rev, "threads": a.threads, "steps_excluding_first": a.steps - 1}
    for k, v in times.items():
        g = statistics.median(x[0] for x in v[1:])
        u = statistics.median(x[1] for x in v[1:])
        out[k] = {"generate_s": g, "update_s": u, "step_s": g + u, "samples_per_s": 128 / (g + u)}
    for part in ("generate_s", "update_s", "step_s"):
        out[f"speedup_{part[:-2]}"] = out["before"][part] / out["now"][part]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
