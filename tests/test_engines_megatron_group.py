"""Rewards of a model-parallel group that is one controller (train.tensor_parallel /
train.pipeline_parallel > 1, mmyatt/engines/megatron_group.py): the group's first rank
scores and the group agrees on its rewards, judge rewards included."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_cli import ROOT, TINY, mmyatt

# ---------------------------------------------------------------------- GroupReward itself


def _group_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as tdist

    from mmyatt.engines.megatron_group import GroupReward
    from mmyatt.rewards.mixture import RewardMixture
    from mmyatt.serving.client import JudgeError, JudgeUnavailableError

    os.environ["OMP_NUM_THREADS"] = "1"
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = []

    class Scored:  # a Reward with a different answer on every rank
        names: list[str] = []
        reads_latents = compares_groups = False
        last_verdicts: list[dict] = []

        def __call__(self, outputs, records, prompt_ids=None):
            calls.append(len(outputs))
            if records[0].get("fail") == "judge":
                raise JudgeUnavailableError("judge down", ["http://x"], None)
            if records[0].get("fail") == "bug":
                raise ValueError("a bug")
            v = torch.tensor([10.0 * rank + i for i in range(len(outputs))])
            return v, {"extra": v + 0.5}

    group = tdist.new_group([0, 1], backend="gloo")
    reward = GroupReward(RewardMixture([("r", Scored(), 2.0, False)]), 0, group)
    got = {"names": reward.names}
    total, parts = reward(["a", "b", "c"], [{}] * 3)
    got.update(total=total, parts=parts, verdicts=reward.last_verdicts)
    for kind in ("judge", "bug"):
        try:
            reward(["a"], [{"fail": kind}])
            got[kind] = None
        except JudgeError as e:
            got[kind] = ("JudgeError", str(e))
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            got[kind] = (type(e).__name__, str(e))
    got["calls"] = calls
    torch.save(got, f"{out}.{rank}")
    tdist.barrier()
    tdist.destroy_process_group()


def test_group_reward_first_rank_scores_for_the_group(tmp_path):
    """Only the group's first rank calls the reward; the other gets its rewards, parts
    and verdicts (a reward that answers differently per rank shows whose they are), and
    a judge error there becomes a JudgeError on every rank, any other a RuntimeError."""
    import torch.multiprocessing as mp

    from mmyatt.distributed import free_port

    out = str(tmp_path / "got")
    mp.start_processes(
        _group_rank, args=(free_port(), out), nprocs=2, start_method="fork", join=True
    )
    a, b = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert a["calls"] == [3, 1, 1] and b["calls"] == []  # the second rank never scored
    assert torch.equal(a["total"], torch.tensor([0.0, 2.0, 4.0]))  # 2 x rank 0's values
    assert torch.equal(b["total"], a["total"])
    assert a["parts"].keys() == b["parts"].keys() == {"r", "extra"}
    for k in a["parts"]:
        assert torch.equal(a["parts"][k], b["parts"][k])
    assert a["verdicts"] == b["verdicts"] == [{}, {}, {}]
    assert a["names"] == b["names"] == ["r"]
    assert a["judge"][0] == b["judge"][0] == "JudgeError"
    assert "judge down" in b["judge"][1] and "first rank" in b["judge"][1]
    assert a["bug"][0] == "ValueError" and b["bug"][0] == "RuntimeError"
    assert "a bug" in b["bug"][1]


# ---------------------------------------------------------------------- judged runs
YES = list("abcdefghijklmABCDEFGHIJKLM01234\n +")
NO = list("nopqrstuvwxyzNOPQRSTUVWXYZ56789.,?=")
CORPUS = ["Question: 12+30= Answer: 42 Is the answer correct? Answer Yes or No. Yes", "No"] * 40


def _rows(run, name):
    return [json.loads(x) for x in (run / name).read_text().splitlines()]


def _series(run, key):
    return torch.tensor([r[key] for r in _rows(run, "metrics.jsonl") if key in r])


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A tiny judge model and the one-process reference run it judges (3 steps): GenRM
    rewards from a judge the run starts, the mass of half its characters against the
    other half's (continuous in its logits), plus a rule."""
    pytest.importorskip("megatron.core")
    from mmyatt.models.builtin.tiny import build_tiny_text_model

    root = tmp_path_factory.mktemp("judged")
    judge = build_tiny_text_model(root / "judge", size="qwen2-0.1m", corpus=CORPUS, seed=1)
    args = [
        str(ROOT / "configs" / "text_grpo_tiny.yaml"),
        *[a for a in TINY if not a.startswith(("trainer.steps", "reward.functions"))],
        "trainer.steps=3",
        "train.backend=megatron",
        f"reward.judge.model={judge}",
        "reward.functions=[{name: genrm, kwargs: {template: yes_no_correct, "
        f"yes_tokens: {json.dumps(YES)}, no_tokens: {json.dumps(NO)}}}}}, "
        "{name: 'lenreward:reward', weight: 0.5}]",
    ]
    mmyatt(root, "train", *args, "distributed.nproc=1", "--run-dir", str(root / "one"))
    rows = _rows(root / "one", "rollouts/rank0.jsonl")
    assert len(rows) == 3 * 16 and all("genrm" in r["verdicts"] for r in rows)
    assert float(torch.tensor([r["parts"]["genrm"] for r in rows]).std()) > 1e-3
    return root, args


def _equals_one_process(judged, name: str, *extra: str, nproc: int = 2):
    root, args = judged
    run, ref = root / name, root / "one"
    n = f"distributed.nproc={nproc}"
    out = mmyatt(root, "train", *args, n, *extra, "--run-dir", str(run))
    assert "1 controller(s)" in out.stdout
    rows, got = _rows(ref, "rollouts/rank0.jsonl"), _rows(run, "rollouts/rank0.jsonl")
    assert [r["output"] for r in got] == [r["output"] for r in rows]
    assert [r["verdicts"]["genrm"]["raw"] for r in got] == [
        r["verdicts"]["genrm"]["raw"] for r in rows
    ]
    # a judge's answers move in the last bits with how its server batches requests
    # (tests/test_placement_modes.py), so equal here means within float32 rounding
    torch.testing.assert_close(
        torch.tensor([r["reward"] for r in got]),
        torch.tensor([r["reward"] for r in rows]),
        rtol=0,
        atol=1e-6,
    )
    torch.testing.assert_close(
        _series(run, "train/loss"), _series(ref, "train/loss"), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        _series(run, "train/grad_norm"), _series(ref, "train/grad_norm"), atol=0, rtol=1e-5
    )
    # the second rank scored nothing and wrote no state into the run directory
    assert not list((run / ".mirror").rglob("*.safetensors"))
    return run


@pytest.mark.slow  # a 2-process run starting a judge server (and the reference run)
@pytest.mark.parametrize("key", ["train.tensor_parallel=2", "train.pipeline_parallel=2"])
def test_judged_model_parallel_group_equals_one_process(judged, key):
    """GenRM rewards with a model-parallel group of 2 processes as one controller (its
    first rank scores and broadcasts) equal one process over 3 steps: same samples,
    per-sample rewards and judge verdicts, losses within 1e-6."""
    _equals_one_process(judged, key.split(".")[1], key)


@pytest.mark.slow  # a 2-process run starting a judge server (and the reference run)
@pytest.mark.parametrize(
    "extra",
    [
        ("train.tensor_parallel=2", "placement.mode=partial", "placement.stream_groups=1"),
        ("train.pipeline_parallel=2", "placement.mode=colocate"),
        ("train.tensor_parallel=2", "placement.mode=auto", "placement.profile_steps=1"),
    ],
    ids=["tp2-partial", "pp2-colocate", "tp2-auto"],
)
def test_judged_placements_with_model_parallel_groups(judged, extra):
    """placement.mode partial (the group's first rank streams chunks to the judge from a
    background thread while the main thread broadcasts the next chunk's rollout),
    colocate and auto (global rank 0 chooses each step's mode for every process: the
    ranks of a group sum other measurements, and without that broadcast this run hangs
    when their choices part) with a model-parallel group: the same samples, rewards and
    losses as the one-process shared run."""
    mode = extra[1].split("=")[1]
    run = _equals_one_process(judged, "-".join(x.split("=")[1] for x in extra[:2]), *extra)
    modes = [r["placement/mode"] for r in _rows(run, "metrics.jsonl") if "placement/mode" in r]
    assert len(modes) == 3
    if mode != "auto":
        assert set(modes) == {mode}
    else:  # warm-up and profile in partial, then its choice
        assert modes[:2] == ["partial", "partial"]


@pytest.mark.slow  # a 4-process run on a 2-core machine starting a judge server
def test_judged_tensor_times_pipeline_parallel_equals_one_process(judged):
    """TP=2 x PP=2: 4 processes, one controller (each stage split over 2 tensor-parallel
    ranks; the gradient norm sums split weights over the tensor-parallel group, then the
    stages; log-probs broadcast along each pipeline) equal one process over 3 steps."""
    run = _equals_one_process(
        judged, "tp2xpp2", "train.tensor_parallel=2", "train.pipeline_parallel=2", nproc=4
    )
    assert sorted(p.name for p in (run / ".mirror").iterdir()) == ["rank1", "rank2", "rank3"]


@pytest.mark.parametrize("key", ["train.tensor_parallel=2", "train.pipeline_parallel=2"])
def test_judge_rewards_are_accepted_with_model_parallel_groups(key):
    """Judge rewards with a model-parallel group were a config error; the group's first
    rank now scores for it."""
    pytest.importorskip("megatron.core")  # else the config error names its install command
    from mmyatt.config.schema import load_config

    cfg = load_config(
        None,
        [
            "train.backend=megatron",
            key,
            "distributed.nproc=2",
            "reward.judge.urls=[http://127.0.0.1:1]",
            "reward.functions=[{name: genrm}]",
        ],
    )
    assert cfg.reward.judge.urls == ("http://127.0.0.1:1",)


@pytest.mark.slow  # three 4-process runs on a 2-core machine
def test_tensor_times_pipeline_parallel_resumes_exactly(tmp_path):
    """TP=2 x PP=2: checkpoints hold every stage's weights and AdamW moments whole and
    HF-named (each rank loads its stage's tensor-parallel shard); 4 steps uninterrupted
    = 2 steps + resume to 4, bit for bit."""
    pytest.importorskip("megatron.core")
    from test_engines_megatron import resumes_exactly

    args = [
        str(ROOT / "configs" / "text_grpo_tiny.yaml"),
        *[a for a in TINY if not a.startswith("trainer.steps")],
        "train.backend=megatron",
        "distributed.nproc=4",
        "train.tensor_parallel=2",
        "train.pipeline_parallel=2",
        "checkpoint.save_every=2",
    ]
    sa = resumes_exactly(tmp_path, *args)
    layers = {
        k.split("layers.")[1].split(".")[0] for k in sa if "exp_avg_sq" in k and "layers." in k
    }
    assert len(layers) >= 2  # moments of both stages' layers
