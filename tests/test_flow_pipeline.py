"""FlowPolicy on standard diffusers pipeline folders (latent space): tiny random
StableDiffusion3Pipeline / FluxPipeline / WanPipeline built from diffusers and
transformers classes, saved with ``save_pretrained`` and loaded with ``FlowPolicy.load``.

The reference for correctness is diffusers itself: a greedy (ODE) rollout must give the
pipeline's own output for the same initial latents (prompt encoding, sigmas, timestep
scaling, latent packing and the VAE's scaling all have to agree for that)."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from adapter_contract import AdapterContract
from test_flow_policy import FLOW_CAPABILITIES

from mmyatt.models.builtin.flow_tiny import build_word_tokenizer
from mmyatt.models.flow import FlowPolicy
from mmyatt.protocols import Sampling, seeded_generator

torch.set_num_threads(1)

PROMPTS = [{"prompt": "a red circle", "id": "p0"}, {"prompt": "a blue square", "id": "p1"}]
LORA = {"r": 4, "alpha": 8}
SEQ = 8  # T5 / UMT5 tokens (the pipelines default to 256-512)
FRAMES = 5  # Wan pixel frames: 3 latent frames with a temporal factor of 2


# --- tiny components ---------------------------------------------------------------------
def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE (CLIP's byte encoder)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def _clip_tokenizer(max_length: int = 16):
    """A CLIPTokenizer with no merges: every byte is a token (514 ids), no download."""
    from transformers import CLIPTokenizer

    chars = _byte_alphabet()
    words = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={w: i for i, w in enumerate(words)}, merges=[], model_max_length=max_length
    )


def _clip(seed: int, dim: int, tok, projection: bool = True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tok.model_max_length,
        projection_dim=dim,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,  # the pooled token is the first eos
        pad_token_id=tok.pad_token_id,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def _t5(seed: int, vocab: int, umt5: bool = False, d_model: int = 16):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kw = {"vocab_size": vocab, "d_model": d_model, "d_kv": 8, "d_ff": 32, "num_layers": 1}
    if umt5:
        return UMT5EncoderModel(UMT5Config(num_heads=2, **kw)).eval()
    return T5EncoderModel(T5Config(num_heads=2, **kw)).eval()


def _image_vae(latent_channels: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(7)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),  # spatial factor 2
        latent_channels=latent_channels,
        norm_num_groups=4,
        layers_per_block=1,
        scaling_factor=1.5,  # not 1 / 0, so a missing (un)scaling shows
        shift_factor=0.1,
    ).eval()


def _word_tok():
    return build_word_tokenizer("a red green blue circle square".split(), max_length=SEQ)


@functools.cache
def _build(kind: str):
    """(diffusers pipeline in memory, its save_pretrained folder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tok = _clip_tokenizer()
    if kind in ("sd3", "sd3-t5"):
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

        torch.manual_seed(0)
        tr = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=48,  # > 16 + 24 CLIP widths: zero padding is exercised
            caption_projection_dim=16,
            pooled_projection_dim=40,
            pos_embed_max_size=8,
        ).eval()
        # the T5 width is the joint width (48)
        t5 = _t5(4, len(_word_tok()), d_model=48) if kind == "sd3-t5" else None
        pipe = StableDiffusion3Pipeline(
            transformer=tr,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_image_vae(4),
            text_encoder=_clip(1, 16, tok),
            text_encoder_2=_clip(2, 24, tok),
            text_encoder_3=t5,
            tokenizer=tok,
            tokenizer_2=tok,
            tokenizer_3=_word_tok() if t5 is not None else None,
        )
    elif kind == "flux":
        from diffusers import FluxPipeline, FluxTransformer2DModel

        torch.manual_seed(0)
        tr = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            axes_dims_rope=[4, 6, 6],
            guidance_embeds=True,  # FLUX.1-dev style embedded guidance
        ).eval()
        sched = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64
        )
        pipe = FluxPipeline(
            transformer=tr,
            scheduler=sched,
            vae=_image_vae(4),
            text_encoder=_clip(3, 16, tok, projection=False),
            text_encoder_2=_t5(4, len(_word_tok())),
            tokenizer=tok,
            tokenizer_2=_word_tok(),
        )
    else:
        from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

        torch.manual_seed(0)
        tr = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=16,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval()
        torch.manual_seed(7)
        vae = AutoencoderKLWan(
            base_dim=4,
            z_dim=4,
            dim_mult=[1, 1],
            num_res_blocks=1,
            temperal_downsample=[True],
            latents_mean=[0.1, -0.2, 0.0, 0.3],
            latents_std=[1.5, 2.0, 0.5, 1.0],
            scale_factor_spatial=2,
            scale_factor_temporal=2,
        ).eval()
        pipe = WanPipeline(
            transformer=tr,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=_t5(5, len(_word_tok()), umt5=True),
            tokenizer=_word_tok(),
        )
    root = Path(tempfile.mkdtemp(prefix="mmyatt-pipe-"))
    atexit.register(shutil.rmtree, root, True)
    pipe.save_pretrained(root / kind)
    return pipe, root / kind


KINDS = ["sd3", "flux", "wan"]


def _load(kind: str, **kw) -> FlowPolicy:
    extra = {"num_frames": FRAMES} if kind == "wan" else {}
    return FlowPolicy.load(_build(kind)[1], image_size=16, max_sequence_length=SEQ, **extra, **kw)


def _final_pixels(policy: FlowPolicy, rollout_fn):
    """Run rollout_fn with to_pixels recorded: (rollout, decoded [-1, 1] tensor)."""
    seen = {}
    orig = policy.to_pixels

    def spy(x):
        seen["px"] = orig(x)
        return seen["px"]

    policy.to_pixels = spy
    try:
        return rollout_fn(), seen["px"]
    finally:
        policy.to_pixels = orig


# --- equality with the diffusers pipelines ----------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "sd3-t5", "flux", "wan"])
def test_greedy_rollout_is_the_pipeline_output(kind):
    pipe, _ = _build(kind)
    policy = _load(kind)
    g = 1.0 if kind == "flux" else 2.0  # Flux: true CFG off; its embedded guidance is used
    s = Sampling(denoise_steps=3, guidance_scale=g, greedy=True)
    r, px = _final_pixels(policy, lambda: policy.generate(PROMPTS[:1], 1, s, seeds=[5]))
    lat = torch.randn((1, *policy.sample_shape), generator=seeded_generator(5, policy.device))
    kw = {"num_inference_steps": 3, "height": 16, "width": 16, "max_sequence_length": SEQ}
    with torch.no_grad():
        if kind == "flux":
            packed = pipe._pack_latents(lat, 1, *policy.sample_shape)
            ref = pipe(PROMPTS[0]["prompt"], latents=packed, guidance_scale=3.5, output_type="pt",
                       **kw).images  # fmt: skip
        elif kind == "wan":
            ref = pipe(PROMPTS[0]["prompt"], latents=lat, guidance_scale=g, num_frames=FRAMES,
                       output_type="pt", **kw).frames  # fmt: skip
            ref = ref.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W) -> (B, C, F, H, W)
        else:
            ref = pipe(PROMPTS[0]["prompt"], latents=lat, guidance_scale=g, output_type="pt",
                       **kw).images  # fmt: skip
    ours = (px.clamp(-1, 1) + 1) / 2  # the pipelines' [0, 1] post-processing
    assert ours.shape == ref.shape
    assert ours.std() > 0.01  # not a blank image that would match anything
    assert torch.allclose(ours, ref.float(), atol=1e-4), (ours - ref).abs().max()
    out = r.outputs[0]
    if kind == "wan":
        assert len(out) == FRAMES and out[0].size == (16, 16)
    else:
        assert out.size == (16, 16)


def test_pipeline_geometry_and_latent_shapes():
    assert _load("sd3").sample_shape == (4, 8, 8)  # 16 px / VAE factor 2
    assert _load("flux").sample_shape == (4, 8, 8)
    assert _load("wan").sample_shape == (4, 3, 8, 8)  # (5 - 1) // 2 + 1 latent frames
    # defaults from the folder: SD3's sample_size (latent) times the VAE factor
    assert FlowPolicy.load(_build("sd3")[1]).image_size == 16


# --- the adapter contract, per pipeline -----------------------------------------------------
class _PipelineContract(AdapterContract):
    kind = "sd3"
    group_size = 2
    capabilities = FLOW_CAPABILITIES

    def make_policy(self):
        return _load(self.kind, lora=LORA)

    def make_prompts(self):
        return [dict(p) for p in PROMPTS]

    def load_policy(self, path):
        return FlowPolicy.load(path)  # geometry and prompt length come from the folder

    def sampling(self):
        return Sampling(denoise_steps=3, noise_level=0.7, guidance_scale=2.0)


class TestSD3PipelineContract(_PipelineContract):
    kind = "sd3"


class TestFluxPipelineContract(_PipelineContract):
    kind = "flux"


class TestWanPipelineContract(_PipelineContract):
    kind = "wan"


# --- Flow-GRPO specifics in latent space -------------------------------------------------------
def _bump_lora(policy: FlowPolicy, value: float = 0.05) -> None:
    with torch.no_grad():
        for n, p in policy.module().named_parameters():
            if "lora_B" in n:
                p.add_(value)


@pytest.mark.parametrize("kind", KINDS)
def test_first_update_ratio_is_exactly_one(kind):
    policy = _load(kind, lora=LORA)
    _bump_lora(policy)
    s = Sampling(denoise_steps=3, noise_level=0.7, guidance_scale=2.0)
    r = policy.generate(PROMPTS, 2, s, seeds=[3, 4])
    assert r.actions.shape[2:] == policy.sample_shape  # transitions are latents
    with torch.no_grad():
        assert torch.equal(policy.logprobs(r), r.logprobs)
    lp = policy.logprobs(r.select([3, 0]))  # with grad, another micro-batch composition
    assert torch.equal(lp.detach(), r.logprobs[[3, 0]])


def test_lora_and_merged_save_load_and_diffusers_reads_the_export(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    policy = _load("sd3", lora=LORA)
    _bump_lora(policy)
    s = Sampling(denoise_steps=3, noise_level=0.7, guidance_scale=2.0)
    r = policy.generate(PROMPTS, 2, s, seeds=[1, 2])
    policy.save(str(tmp_path / "lora"))
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    index = json.loads((tmp_path / "lora" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    loaded = FlowPolicy.load(tmp_path / "lora")
    assert loaded.lora is not None and loaded.vae is not None
    with torch.no_grad():
        assert torch.equal(loaded.logprobs(r), policy.logprobs(r))
    policy.save(str(tmp_path / "merged"), merged=True)
    merged = FlowPolicy.load(tmp_path / "merged")
    assert merged.lora is None
    with torch.no_grad():
        assert torch.allclose(merged.logprobs(r), policy.logprobs(r), atol=1e-4)
    # the merged export is a plain diffusers pipeline: its ODE image is our greedy image
    pipe = StableDiffusion3Pipeline.from_pretrained(
        tmp_path / "merged", text_encoder_3=None, tokenizer_3=None
    )
    greedy = Sampling(denoise_steps=3, guidance_scale=1.0, greedy=True)
    _, px = _final_pixels(policy, lambda: policy.generate(PROMPTS[:1], 1, greedy, seeds=[9]))
    lat = torch.randn((1, *policy.sample_shape), generator=seeded_generator(9, policy.device))
    with torch.no_grad():
        ref = pipe(PROMPTS[0]["prompt"], latents=lat, num_inference_steps=3, guidance_scale=1.0,
                   height=16, width=16, max_sequence_length=SEQ, output_type="pt").images  # fmt: skip
    assert torch.allclose((px.clamp(-1, 1) + 1) / 2, ref, atol=1e-4)


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_sft_loss_is_latent_flow_matching(kind):
    from PIL import Image

    policy = _load(kind, lora=LORA)
    img = Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8))
    key, target = ("frames", [img] * FRAMES) if kind == "wan" else ("image", img)
    recs = [{"prompt": "a red circle", key: target}] * 2
    calls = []
    encode = policy.vae.encode
    policy.vae.encode = lambda x, generator=None: calls.append(x.shape) or encode(x, generator)
    loss = policy.sft_loss(recs, generator=torch.Generator().manual_seed(0))
    assert calls and calls[0][0] == 2  # the targets went through the VAE encoder
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.module().parameters())
    wrong = FlowPolicy.load(_build(kind)[1], image_size=8, max_sequence_length=SEQ,
                            **({"num_frames": FRAMES} if kind == "wan" else {}))  # fmt: skip
    wrong.vae.encode = lambda x, generator=None: torch.zeros(len(x), *policy.sample_shape)
    with pytest.raises(ValueError, match="latents"):
        wrong.sft_loss(recs)


def test_unsupported_pipelines_say_so(tmp_path):
    d = tmp_path / "xl"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(NotImplementedError, match="not supported by FlowPolicy"):
        FlowPolicy.load(d)
    w = tmp_path / "wan22"
    shutil.copytree(_build("wan")[1], w)
    index = json.loads((w / "model_index.json").read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
    (w / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(NotImplementedError, match="not supported by FlowPolicy"):
        FlowPolicy.load(w)
    s = tmp_path / "sched"
    shutil.copytree(_build("sd3")[1], s)
    shutil.rmtree(s / "vae")
    with pytest.raises(FileNotFoundError, match="vae"):
        FlowPolicy.load(s)
