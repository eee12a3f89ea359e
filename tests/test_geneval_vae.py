"""The tiny GenEval's latent space (models/builtin/pretrain_vae.py): a flow model built
on a saved AutoencoderKL samples latents, decodes them to pixels, and saves and loads
with its VAE."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmyatt.models.builtin.flow_tiny import build_tiny_flow_model
from mmyatt.models.builtin.pretrain_flow import pretrain_flow
from mmyatt.models.builtin.pretrain_vae import build_tiny_vae, pretrain_vae
from mmyatt.models.flow import FlowPolicy
from mmyatt.protocols import Sampling


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae")
    m = pretrain_vae(out, steps=2, batch_size=2, block_out_channels=(8, 8, 8), warmup=1)
    assert m["steps"] == 2 and 0.0 <= m["eval_val"]["checker"]["overall"] <= 1.0
    return out


def test_vae_latents_are_normalised_as_sd3s(vae_dir):
    cfg = json.loads((vae_dir / "config.json").read_text())
    m = json.loads((vae_dir / "pretrain_metrics.json").read_text())
    # scaling and shift written by training, not the diffusers defaults (0.18215, None)
    assert cfg["scaling_factor"] == m["scaling_factor"] != 0.18215
    assert cfg["shift_factor"] == m["shift_factor"] is not None


def test_three_levels_quarter_the_side():
    vae = build_tiny_vae((8, 8, 8), latent_channels=4)
    z = vae.encode(torch.zeros(1, 3, 48, 48)).latent_dist.mode()
    assert z.shape == (1, 4, 12, 12)


def test_latent_flow_model_samples_decodes_saves_and_loads(vae_dir, tmp_path):
    vocab = ["a", "red", "blue", "circle", "square"]
    build_tiny_flow_model(
        tmp_path / "m", vocab=vocab, image_size=48, patch_size=1, num_layers=1, vae=vae_dir
    )
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["_mmyatt"]["image_size"] == 48 and index["_mmyatt"]["channels"] == 4
    policy = FlowPolicy.load(tmp_path / "m")
    assert policy.vae is not None and policy.sample_shape == (4, 12, 12)
    assert policy.transformer.config.sample_size == 12
    recs = [{"id": "r0", "prompt": "a red circle"}]
    out = policy.generate(recs, 1, Sampling(denoise_steps=2, greedy=True), [0])
    img = np.asarray(out.outputs[0])
    assert img.shape == (48, 48, 3)  # pixels, decoded by the VAE
    policy.save(str(tmp_path / "saved"))
    again = FlowPolicy.load(tmp_path / "saved")
    a, b = policy.vae.vae.state_dict(), again.vae.vae.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out2 = again.generate(recs, 1, Sampling(denoise_steps=2, greedy=True), [0])
    assert np.array_equal(np.asarray(out2.outputs[0]), img)


def test_pretraining_learns_in_the_latent_space(vae_dir, tmp_path):
    m = pretrain_flow(
        tmp_path / "g",
        task="geneval",
        image_size=48,
        patch_size=1,
        num_layers=1,
        steps=1,
        batch_size=2,
        vae=vae_dir,
        eval_guidance=(),
        log_every=0,
        eval_steps=1,
    )
    assert m["vae"] == str(vae_dir) and m["steps_done"] == 1
    assert FlowPolicy.load(tmp_path / "g").sample_shape == (4, 12, 12)


def test_vae_refuses_video_and_uneven_sizes(vae_dir, tmp_path):
    with pytest.raises(ValueError, match="vae is for sd3-image"):
        build_tiny_flow_model(tmp_path / "v", kind="wan-video", vocab=["a"], vae=vae_dir)
    with pytest.raises(ValueError, match="multiple of the VAE's 4"):
        build_tiny_flow_model(tmp_path / "u", vocab=["a"], image_size=50, vae=vae_dir)
