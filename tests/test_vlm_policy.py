"""VLMPolicy on tiny locally built Qwen2-VL / Qwen2.5-VL: the adapter contract plus VLM specifics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from adapter_contract import AdapterContract
from PIL import Image, ImageDraw

from mmyatt.datasets.media import image_to_data_url, write_video
from mmyatt.models.builtin.tiny_vlm import VISION_TOKENS, build_tiny_vlm
from mmyatt.models.vlm import VLMPolicy
from mmyatt.models.vlm_inputs import PromptTooLongError
from mmyatt.protocols import (
    DecoderFlops,
    MediaPrompts,
    ReferenceKL,
    Sampling,
    SupervisedPolicy,
    TokenPolicy,
)

torch.set_num_threads(1)

CORPUS = [
    "What colour is the shape? red",
    "Is it a circle? Yes",
    "Which way does it move? left",
] * 8


def square(colour: str, x: int = 10) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle([x, 14, x + 24, 38], fill=colour)
    return image


def moving_frames(n: int = 4) -> np.ndarray:
    return np.stack([np.asarray(square("blue", x=4 + 6 * t)) for t in range(n)])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), arch="qwen2-vl", corpus=CORPUS)


@pytest.fixture(scope="module")
def tiny25_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm25"), arch="qwen2.5-vl", corpus=CORPUS)


@pytest.fixture
def policy(tiny_dir):
    return VLMPolicy.load(tiny_dir, max_prompt_tokens=48)


class TestVLMPolicyContract(AdapterContract):
    capabilities = (TokenPolicy, MediaPrompts, DecoderFlops, ReferenceKL, SupervisedPolicy)

    @pytest.fixture(autouse=True)
    def _model_dir(self, tiny_dir):
        self.model_dir = tiny_dir

    def make_policy(self):
        return VLMPolicy.load(self.model_dir, max_prompt_tokens=48)

    def make_prompts(self):
        return [
            {"prompt": "What colour is the shape?", "image": square("red"), "id": "red"},
            {"prompt": "Is it a circle?", "image": square("green", x=20), "id": "green"},
        ]

    def load_policy(self, path):
        return VLMPolicy.load(path, max_prompt_tokens=48)

    def test_rollout_shapes(self):
        super().test_rollout_shapes()  # the contract, plus: media stay aligned with samples
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        n = len(prompts) * self.group_size
        assert len(r.context["media"]) == n and r.context["input_ids"].shape[0] == n


# --- the builder ------------------------------------------------------------------------
def test_tiny_vlm_loads_with_plain_transformers(tiny_dir):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    processor = AutoImageProcessor.from_pretrained(str(tiny_dir))
    assert model.config.model_type == "qwen2_vl"
    assert 0.15e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    for token in VISION_TOKENS:
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1
    for word in ("Yes", "No"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1
    out = processor(images=[square("red")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_unknown_arch_and_size(tmp_path):
    with pytest.raises(ValueError, match="qwen2.5-vl"):
        build_tiny_vlm(tmp_path, arch="llava", corpus=CORPUS)
    with pytest.raises(ValueError, match="small"):
        build_tiny_vlm(tmp_path, size="huge", corpus=CORPUS)


def test_load_missing_files_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        VLMPolicy.load(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        VLMPolicy.load(tmp_path)


# --- media and prompts ------------------------------------------------------------------
def test_56px_image_is_four_tokens(policy):
    assert policy.image_token_count(square("red")) == 4
    prep = policy.prepare({"prompt": "What colour?", "image": square("red")}, 0)
    ids = torch.tensor(prep["ids"])
    assert int((ids == policy.image_token_id).sum()) == 4
    assert prep["media"]["pixel_values"].shape == (16, 3 * 2 * 14 * 14)


def test_still_video_matches_image_pixels(policy):
    frames = np.stack([np.asarray(square("red"))] * 2)
    video, grid = policy.prompts.video_inputs(frames)
    image = policy.prepare({"prompt": "x", "image": square("red")}, 0)["media"]["pixel_values"]
    assert grid.tolist() == [[1, 4, 4]]
    assert torch.allclose(video, image, atol=1e-5)


def test_video_prompt_rollout_ratio_one(policy, tmp_path):
    path = write_video(moving_frames(4), tmp_path / "clip.mp4", fps=2.0)
    prompts = [
        {"prompt": "Which way does it move?", "video": str(path), "id": "file"},
        {"prompt": "Which way does it move?", "video": moving_frames(4), "id": "frames"},
    ]
    r = policy.generate(prompts, 2, Sampling(max_new_tokens=6), [1, 2])
    ids = r.context["input_ids"][0]
    assert int((ids == policy.video_token_id).sum()) == 8  # grid [2, 4, 4] / merge 2x2
    assert r.context["media"][0]["video_grid_thw"].tolist() == [[2, 4, 4]]
    with torch.no_grad():
        lp = policy.logprobs(r)
    m = r.mask.bool()
    assert torch.allclose(torch.exp(lp[m] - r.logprobs[m]), torch.ones(int(m.sum())), atol=1e-5)


def test_ratio_one_with_image_paths_and_qwen25(tiny25_dir, tmp_path):
    policy = VLMPolicy.load(tiny25_dir, max_prompt_tokens=48)
    square("red").save(tmp_path / "red.png")
    prompts = [
        {"prompt": "What colour is the shape?", "image": str(tmp_path / "red.png")},
        {"prompt": "Which way?", "video": moving_frames(6), "video_fps": 2.0},
        {"prompt": "Hi"},
    ]
    r = policy.generate(prompts, 2, Sampling(max_new_tokens=6), [3, 4, 5])
    with torch.no_grad():
        lp = policy.logprobs(r)
    m = r.mask.bool()
    assert torch.allclose(lp[m], r.logprobs[m], atol=1e-5)
    # select / concat keep per-sample media aligned with the rows
    part = type(r).concat([r.select([4, 5]), r.select([0, 1])])
    with torch.no_grad():
        lp2 = policy.logprobs(part)
    assert torch.allclose(lp2, torch.cat([lp[4:6], lp[0:2]]), atol=1e-5)


def test_padding_columns_are_left_out_of_generation_and_kept_in_the_rollout(tiny_dir):
    # an image prompt and a clip prompt at P = 48 and at P = 160: the second's forward
    # passes leave out its extra padding columns, so the samples are the same and so are
    # their log-probs up to float rounding; its rollout is still P wide
    prompts = [
        {"prompt": "What colour is the shape?", "image": square("red"), "id": "image"},
        {"prompt": "Which way does it move?", "video": moving_frames(4), "id": "clip"},
    ]
    s = Sampling(max_new_tokens=5)
    narrow, wide = (VLMPolicy.load(tiny_dir, max_prompt_tokens=n) for n in (48, 160))
    a = narrow.generate(prompts, 2, s, [3, 4])
    widths = []
    forward = wide.model.forward
    wide.model.forward = lambda *x, **k: widths.append(k["input_ids"].shape[1]) or forward(*x, **k)
    b = wide.generate(prompts, 2, s, [3, 4])
    assert widths[0] < 48  # the prefill: the longest prompt's width
    assert torch.equal(a.actions, b.actions) and torch.equal(a.mask, b.mask)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert b.context["input_ids"].shape == (4, 160 + 5)
    assert torch.equal(b.context["input_ids"][:, -53:], a.context["input_ids"])
    assert int(b.context["attention_mask"][:, :-53].sum()) == 0
    with torch.no_grad():
        lp = wide.logprobs(b)
    m = b.mask.bool()
    assert torch.allclose(lp[m], b.logprobs[m], atol=1e-5)


def test_never_samples_vision_tokens(policy):
    # Make the vision tokens the most likely ones: sampling must still avoid them.
    head = policy.module().get_output_embeddings()
    with torch.no_grad():
        for tok in (policy.image_token_id, policy.video_token_id):
            head.weight[tok] = head.weight[tok] * 0 + 5.0 * head.weight.abs().max()
    prompts = [{"prompt": "What colour?", "image": square("red")}, {"prompt": "Hi"}]
    r = policy.generate(prompts, 4, Sampling(max_new_tokens=12, temperature=2.0), [1, 2])
    assert not torch.isin(r.actions, torch.tensor(policy.banned_ids)).any()


def test_prompt_too_long(policy):
    with pytest.raises(PromptTooLongError, match="max_prompt_tokens"):
        policy.generate([{"prompt": "word " * 60, "image": square("red")}], 1, Sampling(), [0])


def test_sft_loss_counts_completion_only(policy):
    records = [
        {"prompt": "What colour is the shape?", "image": square("red"), "answer": "red"},
        {"prompt": "Which way?", "video": moving_frames(4), "answer": "left"},
    ]
    loss = policy.sft_loss(records)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert policy.module().model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_reference_is_frozen_copy(policy):
    prompts = [{"prompt": "What colour?", "image": square("red")}]
    r = policy.generate(prompts, 2, Sampling(max_new_tokens=4), [1])
    policy.enable_reference()
    with torch.no_grad():
        for p in policy.module().parameters():
            p.add_(0.05)
    ref = policy.reference_logprobs(r)
    m = r.mask.bool()
    assert torch.allclose(ref[m], r.logprobs[m], atol=1e-5)
    assert not torch.allclose(policy.logprobs(r)[m], r.logprobs[m], atol=1e-3)


# --- judge helpers ----------------------------------------------------------------------
def test_next_token_logprobs_data_url(policy):
    url = image_to_data_url(square("red"))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Is it red? Answer Yes or No."},
            ],
        }
    ]
    plain = [{"role": "user", "content": "Is it red?"}]
    tops = policy.next_token_logprobs([messages, plain], top_k=400)
    assert len(tops) == 2
    tokens = [t for t, _ in tops[0]]
    assert "Yes" in tokens and "No" in tokens
    probs = np.exp([lp for _, lp in tops[0]])
    assert probs.sum() <= 1 + 1e-5 and all(a >= b for a, b in zip(probs, probs[1:]))
    assert not any(t in VISION_TOKENS for t in tokens)
    top3 = policy.next_token_logprobs([messages], top_k=3)[0]
    assert [t for t, _ in top3] == tokens[:3]


def test_generate_text_seeded(policy):
    messages = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": square("red")},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ]
    ]
    a = policy.generate_text(messages, max_new_tokens=5, temperature=1.0, seeds=[3])
    b = policy.generate_text(messages, max_new_tokens=5, temperature=1.0, seeds=[3])
    assert a == b and isinstance(a[0][0], str)
    assert 1 <= len(a[0][1]) <= 5 and all(lp <= 0 for lp in a[0][1])
    greedy = policy.generate_text(messages, max_new_tokens=5, temperature=0.0, seeds=[0])
    # greedy ignores the seed, and each taken token's log-prob is at most 0
    assert greedy == policy.generate_text(messages, max_new_tokens=5, temperature=0.0, seeds=[9])
    assert len(greedy) == 1 and isinstance(greedy[0][0], str)
    assert 1 <= len(greedy[0][1]) <= 5 and all(lp <= 0 for lp in greedy[0][1])


# --- the built-in judge -----------------------------------------------------------------
BUILTIN_JUDGE = Path(__file__).resolve().parents[1] / "models" / "builtin" / "tiny_judge"


@pytest.mark.skipif(not BUILTIN_JUDGE.is_dir(), reason="no built-in tiny judge checkpoint")
def test_builtin_tiny_judge_answers_yes_no():
    """On the combinations it was trained on; the held-out ones it never saw are its
    known weakness (models/builtin/tiny_judge/README.md)."""
    from mmyatt.datasets.shapes import HELDOUT
    from mmyatt.datasets.vision_tasks import judge_records
    from mmyatt.models.builtin.train_tiny_judge import judge_accuracy

    judge = VLMPolicy.load(BUILTIN_JUDGE, max_prompt_tokens=64)
    records = judge_records(48, seed=123, exclude=HELDOUT)
    metrics = judge_accuracy(judge, records, batch_size=48, top_k=5)
    assert metrics["accuracy"] >= 0.9, metrics
