"""TRL's GRPOTrainer on the workload of `mmyatt bench text-grpo`, timed per step.

Run by bench/trl_side_by_side.py with the python of TRL's own throwaway venv (see
bench/trl_venv.sh); it imports nothing from mmyatt. Writes JSON: per-step wall seconds
(generation, reward and update: everything between the trainer's step-begin and
step-end callbacks), the versions, and the settings used.

    python bench/trl_grpo_arm.py --model DIR --prompts P.jsonl --steps 8 --threads 2 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSONL with 'prompt' and 'answer'")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import datasets

    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows = [json.loads(x) for x in open(a.prompts) if x.strip()]
    need = a.prompts_per_step * a.steps
    rows = rows[:need]
    if len(rows) < need:
        raise SystemExit(f"{a.prompts} has {len(rows)} prompts, {need} needed")
    data = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "answer": str(r.get("answer", ""))} for r in rows]
    )

    def exact_answer(prompts, completions, answer, **_):  # rule reward, as cheap as ours
        return [float(c.strip() == x) for c, x in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self._t0)

    timer = StepTimer()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=a.prompts_per_step * a.group,  # completions per step
            num_generations=a.group,
            max_completion_length=a.new_tokens,
            temperature=1.0,
            top_p=1.0,
            learning_rate=a.lr,
            beta=0.0,  # no reference model, as in the mmyatt bench
            num_iterations=1,
            gradient_accumulation_steps=1,
            max_steps=a.steps,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=a.seed,
            shuffle_dataset=False,
            dataloader_pin_memory=False,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_answer,
            args=cfg,
            train_dataset=data,
            processing_class=tok,
            callbacks=[timer],
        )
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    out = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": a.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "prompts_per_step": a.prompts_per_step,
        "group_size": a.group,
        "max_new_tokens": a.new_tokens,
        "step_seconds": timer.seconds,
        "train_wall_s": wall,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
