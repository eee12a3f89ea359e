"""Supervised warm start: cross-entropy on completion tokens only.

RL from a random policy never sees a reward; a short SFT gives it a modest start.
Stopping on a held-out accuracy threshold (not a fixed time) matters at small scale:
the jump from chance to competence happens at a seed-dependent moment.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from mmyatt.config.schema import ConfigError, RewardSpec, RunConfig
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.protocols import Sampling
from mmyatt.step import builders


def greedy_accuracy(policy, reward, records: list[dict], max_new_tokens: int) -> float:
    if not records:
        return 0.0
    s = Sampling(greedy=True, max_new_tokens=max_new_tokens)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(records), 128):
            chunk = records[i : i + 128]
            r = policy.generate(chunk, 1, s, list(range(len(chunk))))
            total += float(reward(r.outputs, r.records, r.prompt_ids)[0].sum())
    return total / len(records)


def run_sft(cfg: RunConfig, out_dir: Path, log=print) -> dict:
    """Train cfg.model.path on the train manifest; write an HF checkpoint to out_dir."""
    s = cfg.sft
    judged = any(f.name == "genrm" for f in cfg.reward.functions)
    if s.check is None and judged and not cfg.reward.judge.urls:
        raise ConfigError(
            "sft.enabled=true: the warm start runs before the judge servers start "
            "(reward.judge.model), and its stopping check scores with the run's reward, which "
            "has a genrm term; set sft.check to a rule reward (e.g. sft.check=numeric_match), "
            "give reward.judge.urls of running servers, or set sft.enabled=false"
        )
    torch.manual_seed(cfg.trainer.seed)
    torch.set_num_threads(s.threads)
    model = cfg.model if s.freeze is None else cfg.model.model_copy(update={"freeze": s.freeze})
    policy = builders.build_policy(model)
    if s.check is not None:  # one rule, e.g. when the run's reward is a judge not yet started
        reward = builders.build_reward(
            cfg.reward.model_copy(update={"functions": (RewardSpec(name=s.check),)})
        )
    else:
        reward = builders.build_reward(cfg.reward)
    train = ShardedManifest(
        builders.manifest_paths(s.data or cfg.data.train),
        seed=cfg.trainer.seed,
        bad_lines=cfg.data.bad_lines,
    )
    if cfg.data.val:
        check, split = cfg.data.val, "validation"
    else:
        check, split = cfg.data.eval, "eval"
        log(
            "[sft] no data.val: the stopping check reads data.eval, the split the run reports; "
            "set data.val to keep them apart"
        )
    held = ShardedManifest(
        builders.manifest_paths(check), shuffle=False, bad_lines=cfg.data.bad_lines
    ).eval_records(s.eval_prompts)
    params = [p for p in policy.module().parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr)
    rng = random.Random(cfg.trainer.seed)
    t0 = time.perf_counter()
    acc, step, history = 0.0, 0, []
    log(
        f"[sft] up to {s.max_steps} steps, batch {s.batch_size}, lr {s.lr}, "
        f"stop at {split} accuracy {s.stop_at_accuracy} ({check})"
    )
    for step in range(1, s.max_steps + 1):
        batch = train.next_batch(s.batch_size)
        rng.shuffle(batch)
        loss = policy.sft_loss(batch, target_key=s.target_key)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % s.eval_every == 0 or step == s.max_steps:
            acc = greedy_accuracy(policy, reward, held, cfg.sampling.max_new_tokens)
            history.append({"step": step, "loss": float(loss.detach()), "accuracy": acc})
            log(
                f"[sft] step {step} loss {float(loss.detach()):.4f} {split} greedy accuracy {acc:.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
            if s.stop_at_accuracy is not None and acc >= s.stop_at_accuracy:
                break
    policy.save(str(out_dir))
    log(f"[sft] saved {out_dir} after {step} steps, accuracy {acc:.3f}")
    return {"steps": step, "accuracy": acc, "seconds": time.perf_counter() - t0, "history": history}
