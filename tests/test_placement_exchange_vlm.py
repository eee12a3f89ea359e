"""placement.balance with a VLM policy: samples move between controllers with their
vision features (the frozen vision tower's output), never their pixels, and train
exactly as they would where they were generated."""

from __future__ import annotations

import json

import pytest
import torch

LENGTH_REWARD = "def reward(completion, record):\n    return len(completion) / 10.0\n"


def test_encoded_features_give_the_pixels_log_probs():
    """The forward from encode_media's features equals the one from pixels, for images,
    clips and prompts without media, on both architectures; select and concat keep the
    features with their rows; a trainable vision tower is refused."""
    import tempfile
    from pathlib import Path

    from test_vlm_policy import CORPUS, moving_frames, square

    from mmyatt.models.builtin.tiny_vlm import build_tiny_vlm
    from mmyatt.models.vlm import VLMPolicy
    from mmyatt.protocols import Sampling
    from mmyatt.rollout import Rollout

    for arch in ("qwen2-vl", "qwen2.5-vl"):
        path = build_tiny_vlm(Path(tempfile.mkdtemp()), arch=arch, corpus=CORPUS)
        policy = VLMPolicy.load(path, max_prompt_tokens=48)
        prompts = [
            {"prompt": "What colour is the shape?", "image": square("red")},
            {"prompt": "Which way does it move?", "video": moving_frames(4)},
            {"prompt": "Hi"},
        ]
        r = policy.generate(prompts, 2, Sampling(max_new_tokens=6), [1, 2, 3])
        with pytest.raises(ValueError, match=r"vision tower must be frozen \(model.freeze"):
            policy.encode_media(r)
        for name, p in policy.model.named_parameters():
            if "visual." in name:
                p.requires_grad_(False)
        policy.enable_reference()
        e = policy.encode_media(r)
        media = e.context["media"]
        assert all("pixel_values" not in m and "pixel_values_videos" not in m for m in media)
        assert media[0] is media[1]  # a prompt's samples share their features
        assert len(media[0]["image_embeds"]) == 4 and len(media[2]["video_embeds"]) == 8
        with torch.no_grad():
            lp, le = policy.logprobs(r), policy.logprobs(e)
            torch.testing.assert_close(le, lp, rtol=0, atol=1e-6)
            ref = policy.reference_logprobs(e)
            torch.testing.assert_close(ref, policy.reference_logprobs(r), rtol=0, atol=1e-6)
            part = Rollout.concat([e.select([4, 5]), e.select([0, 1])])
            torch.testing.assert_close(policy.logprobs(part), torch.cat([lp[4:6], lp[0:2]]))
        with pytest.raises(RuntimeError, match="mixes pixels and encoded"):
            policy.logprobs(Rollout.concat([e.select([0]), r.select([2])]))


def test_two_controllers_balance_vlm_steps_with_the_update_unchanged(tmp_path):
    """Two controllers on a skewed manifest (rank 0 reads the long prompts, rank 1 the
    short ones, an image each): balanced, samples move with their vision features and
    the weights after two steps are those of the run without balancing."""
    from PIL import Image
    from test_cli import ROOT, mmyatt
    from test_engines_fsdp2 import losses, weights
    from test_recipes import SMALL

    (tmp_path / "lenreward.py").write_text(LENGTH_REWARD)
    (tmp_path / "images").mkdir()
    rows = []
    for i in range(16):
        Image.new("RGB", (56, 56), (i * 15, 80, 200 - i * 10)).save(tmp_path / f"images/{i}.png")
        prompt = "What colour is the shape? " * 4 if i % 2 == 0 else "Colour?"
        rows.append({"prompt": prompt, "answer": "red", "image": f"images/{i}.png"})
    data = tmp_path / "skewed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        *[a for a in SMALL if not a.startswith(("trainer.steps", "distributed.nproc"))],
        f"data.train={data}",
        f"data.eval={data}",
        "data.shuffle=false",
        "model.max_prompt_tokens=80",
        "model.freeze=[model.visual]",
        "sft.enabled=false",
        "algorithm.dynamic_sampling=false",
        "reward.functions=[{name: 'lenreward:reward'}]",
        "trainer.steps=2",
        "distributed.nproc=2",
        "data.prompts_per_step=4",
        "sampling.group_size=4",
        "placement.balance_when=always",  # every step, by token counts
    ]
    cfg = str(ROOT / "configs" / "vlm_grpo_image_tiny.yaml")
    runs = {}
    for on in (False, True):
        runs[on] = tmp_path / f"balance_{on}"
        flag = f"placement.balance={str(on).lower()}"
        mmyatt(tmp_path, "train", cfg, *args, flag, "--run-dir", str(runs[on]))
    rows = [json.loads(x) for x in (runs[True] / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "placement/balance_moved" in r]
    assert len(steps) == 2 and sum(r["placement/balance_moved"] for r in steps) > 0, steps
    assert all(r["placement/balance_before"] > 1.2 for r in steps), steps  # the skew
    assert all(r["placement/balance_after"] <= 1.10 for r in steps), steps
    assert all(r["timing/encode_media_s"] > 0 for r in steps)
    wa, wb = weights(runs[False]), weights(runs[True])
    assert wa.keys() == wb.keys() and wa
    for k in wa:  # the same samples, summed in another order
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    assert len(losses(runs[True])) == len(losses(runs[False])) == 2
