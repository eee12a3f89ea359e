"""The prepared GPU run (bench/gpu_run.sh) and its flow bench, dry-run on the CPU.

In the default suite: the SD3 FLOP count of ``mmyatt bench flow-real`` against torch's
FLOP counter on a real forward, the script's syntax, the flow bench at tiny shapes
(seconds), and the decode bench's arms at tiny shapes. Slow (about 2 minutes on 2 idle cores, far more when they are busy): the
whole script's dry run, whose one JSON must hold every part with measured, finite
figures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmyatt.bench.engines import bench_engines
from mmyatt.bench.flow_real import (
    SD35_MEDIUM_TRANSFORMER,
    SIZES,
    bench_flow_real,
    sd3_forward_flops,
)
from mmyatt.bench.registry import BENCHES
from mmyatt.placement.bench_figures import MODES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_run.sh"


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("dual", [(), (0,)])
def test_sd3_flop_formula_matches_the_counted_forward(dual):
    cfg = {**SIZES["tiny"]["transformer"], "dual_attention_layers": dual, "num_layers": 3}
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**cfg).eval()
    latent, text = 16, 20  # (16/2)^2 = 64 image tokens
    x = torch.randn(1, cfg["in_channels"], latent, latent)
    cond = torch.randn(1, text, cfg["joint_attention_dim"])
    pooled = torch.randn(1, cfg["pooled_projection_dim"])
    counter = FlopCounterMode(display=False)
    # the math attention: its matmuls are counted (the fused CPU kernel is not)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(hidden_states=x, encoder_hidden_states=cond, pooled_projections=pooled,
              timestep=torch.tensor([500.0]))  # fmt: skip
    counted = counter.get_total_flops()
    formula = sd3_forward_flops(cfg, (latent // 2) ** 2, text)
    assert counted > 0
    assert abs(formula / counted - 1) < 1e-3, (formula, counted)


def test_sd35_medium_flops_are_of_the_expected_size():
    """512x512 (1024 image tokens) with 333 text tokens: 2.2-2.6 TFLOP per forward. The
    config has 2.24 B parameters (and a 226 M position table, a buffer): 2 x params x
    tokens bounds the count from above (the adaLN weights act once per row, not per
    token)."""
    f = sd3_forward_flops(SD35_MEDIUM_TRANSFORMER, 1024, 333)
    assert 2.2e12 < f < 2.6e12
    assert f < 2 * 2.5e9 * (1024 + 333)
    with torch.device("meta"):
        params = sum(
            p.numel() for p in SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER).parameters()
        )
    assert 2.2e9 < params < 2.3e9


def test_flow_real_is_registered_and_the_script_parses():
    assert BENCHES["flow-real"] == "mmyatt.bench.flow_real:bench_flow_real"
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def _check_flow_real(r: dict) -> None:
    assert r["benchmark"] == "flow-real" and r["size"] == "tiny"
    for phase in ("rollout_mmyatt", "rollout_diffusers", "update_flow_grpo", "update_nft"):
        for key in ("seconds", "images_per_s", "achieved_tflop_per_s"):
            assert _finite_positive(r[phase][key]), (phase, key, r[phase][key])
    assert _finite_positive(r["rollout_ratio_mmyatt_over_diffusers"])
    assert r["update_flow_grpo"]["rows"] == r["images_per_rollout"] * r["denoise_steps"]
    assert set(r["memory"]) >= {"rollout_mmyatt", "rollout_diffusers", "update_flow_grpo",
                                "update_nft"}  # fmt: skip
    assert all(_finite_positive(m["cpu_rss_gb"]) for m in r["memory"].values())


def test_flow_real_tiny_measures_every_phase():
    _check_flow_real(bench_flow_real(size="tiny", device="cpu"))


def test_decode_bench_tiny_measures_every_path():
    _check_decode(bench_engines(quick=True, decode=True, compile_backend="eager"))


def _check_decode(r: dict) -> None:
    """The decode arms: every path measured, text and VLM, drawing the default path's samples."""
    assert r["benchmark"] == "engines-decode" and not r["skipped"], r["skipped"]
    arms = {**r["arms"], **r["vlm_arms"]}
    assert set(arms) == {
        "hf_replica", "hf_replica_static", "hf_replica_compiled",
        "vlm_replica_default", "vlm_replica_static", "vlm_replica_compiled",
    }  # fmt: skip
    for name, a in arms.items():
        assert _finite_positive(a["rollout_tokens_per_s"]), name
        assert _finite_positive(a["update_tflops_per_s"]), name
        if "static" in name or "compiled" in name:  # tiny fp32 models: the very same tokens
            assert a["same_samples_as_default"]["rows_same_tokens"] == 1.0, name
    assert set(r["rollout_speed_over_default"]) == {
        "text_static", "text_compiled", "vlm_static", "vlm_compiled"
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(2100)  # the script's own limit (TIME_LIMIT_S) bounds it, not the default
def test_gpu_script_dry_run_writes_one_json_with_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "TIME_LIMIT_S": "1600"}  # fmt: skip
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=2000)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads((tmp_path / "gpu_figures.json").read_text())
    assert fig["dry_run"] is True and fig["date"] and fig["revision"]
    assert set(fig["parts"]) == {
        "pytest_gpu", "flow_real", "engines", "decode", "logprob_memory", "placement"
    }  # fmt: skip
    for name, part in fig["parts"].items():
        assert part["exit_status"] == 0, (name, part)
    tests = fig["pytest_gpu"]
    assert tests["tests"] > 0 and tests["failures"] == 0 and tests["errors"] == 0
    _check_flow_real(fig["flow_real"])
    arms = fig["engines"]["arms"]
    assert arms and all(
        _finite_positive(v) for a in arms.values() for k, v in a.items() if k.endswith("_s")
    )
    _check_decode(fig["decode"])
    for arm in fig["logprob_memory"]["arms"].values():
        assert "error" not in arm and _finite_positive(arm["seconds"]), arm
    placement = fig["placement"]["judge_heavy"]
    for mode in MODES:
        assert _finite_positive(placement[mode]["step_s"]), (mode, placement.get(mode))
