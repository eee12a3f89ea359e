"""Rollout logs, the run reader and the HTML report, on hand-made rollouts (fast), and
the judge's verdicts as GenRMReward and RewardMixture expose them."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image

from mmyatt.config.schema import ConfigError, load_config
from mmyatt.outputs.rollout_log import truncate_rollouts, write_rollouts
from mmyatt.outputs.trackers import make_logger  # also registers the trackers' config check
from mmyatt.report.html import write_report
from mmyatt.report.inspect import load_run, metrics_frame
from mmyatt.rewards.genrm import GenRMReward
from mmyatt.rewards.mixture import RewardMixture
from mmyatt.rollout import Rollout


def yes_no_response(token: str, p_yes: float) -> dict:
    top = [
        {"token": "Yes", "logprob": math.log(p_yes)},
        {"token": "No", "logprob": math.log(1 - p_yes)},
    ]
    return {
        "choices": [
            {"logprobs": {"content": [{"token": token, "logprob": -0.1, "top_logprobs": top}]}}
        ]
    }


class CannedClient:
    """chat_many returns one scripted response per request, in order."""

    def __init__(self, responses: list[dict]):
        self.responses = list(responses)
        self.bodies: list[dict] = []

    def chat_many(self, bodies):
        self.bodies += bodies
        out, self.responses = self.responses[: len(bodies)], self.responses[len(bodies) :]
        return out


def test_genrm_exposes_question_raw_answer_and_parsed_verdict():
    client = CannedClient([yes_no_response("Yes", 0.8), yes_no_response("No", 0.25)])
    judge = GenRMReward(client, template="yes_no_correct")
    total, _ = judge(["4", "5"], [{"prompt": "2+2="}, {"prompt": "2+2="}])
    v = judge.last_verdicts
    assert [x["raw"] for x in v] == ["Yes", "No"]
    # P(Yes) / (P(Yes) + P(No)) with both sides in the top-k: 0.8 and 0.25 exactly
    assert [x["verdict"] for x in v] == pytest.approx([0.8, 0.25], abs=1e-6)
    assert total.tolist() == pytest.approx([0.8, 0.25], abs=1e-6)
    assert "2+2=" in v[0]["question"] and "4" in v[0]["question"]
    assert v[0]["top_logprobs"][0] == ["Yes", pytest.approx(math.log(0.8), abs=1e-4)]


def test_genrm_score_mode_keeps_the_generated_text():
    texts = ["Looks right. Score: 8", "no idea"]
    responses = [{"choices": [{"message": {"content": t}}]} for t in texts]
    judge = GenRMReward(CannedClient(responses), mode="score", template="score_text_1_10")
    judge(["a", "b"], [{"prompt": "q"}, {"prompt": "q"}])
    v = judge.last_verdicts
    assert v[0]["raw"] == ["Looks right. Score: 8"] and v[0]["values"] == [0.8]
    assert v[1]["values"] == [None] and v[1]["verdict"] == 0.0  # parse failure: fallback


def test_mixture_collects_verdicts_per_sample_by_term():
    client = CannedClient([yes_no_response("Yes", 0.9), yes_no_response("No", 0.1)])
    judge = GenRMReward(client, template="yes_no_correct")
    mix = RewardMixture([("genrm", judge, 1.0, False)])
    mix(["4", "5"], [{"prompt": "2+2="}] * 2)
    assert [v["genrm"]["raw"] for v in mix.last_verdicts] == ["Yes", "No"]


def handmade_rollout(step_images: bool = True) -> Rollout:
    """3 prompts x 2 samples; images of known colours; advantages per action for sample 0."""
    n = 6
    images = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(n)]
    verdicts = [
        {
            "genrm": {
                "mode": "yes_prob",
                "question": "red?",
                "raw": "Yes" if i % 2 else "No",
                "values": [i / 5],
                "verdict": i / 5,
            }
        }
        for i in range(n)
    ]
    return Rollout(
        prompt_ids=["a", "a", "b", "b", "c", "c"],
        actions=torch.zeros(n, 3),
        logprobs=torch.zeros(n, 3),
        mask=torch.tensor([[1.0, 1.0, 0.0]] * n),
        context={},
        outputs=images if step_images else [f"out{i}" for i in range(n)],
        records=[{"prompt": f"p{i // 2}", "split": "heldout"} for i in range(n)],
        rewards=torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        reward_parts={
            "genrm": torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
            "rule": torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
        },
        advantages=torch.tensor([[1.0, 3.0, 99.0]] + [[0.5, 0.5, 0.5]] * 5),
        verdicts=verdicts,
    )


def test_rollout_log_keeps_whole_groups_within_the_cap(tmp_path):
    r = handmade_rollout()
    rows = write_rollouts(tmp_path, 0, 7, r, cap=5)  # 2 whole groups = 4 samples
    assert [(x["group"], x["sample"]) for x in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = rows[0]
    assert first["advantage"] == 2.0  # (1 + 3) / 2: the masked action does not count
    assert first["length"] == 2 and first["split"] == "heldout"
    assert first["parts"] == {"genrm": 0.0, "rule": 1.0}
    assert first["verdicts"]["genrm"]["raw"] == "No"
    assert Image.open(tmp_path / first["output_file"]).getpixel((0, 0)) == (0, 0, 0)
    assert write_rollouts(tmp_path, 0, 8, r, cap=1) and True  # one group even past the cap
    lines = (tmp_path / "rollouts" / "rank0.jsonl").read_text().splitlines()
    assert len(lines) == 4 + 2
    truncate_rollouts(tmp_path, 0, 7)
    lines = (tmp_path / "rollouts" / "rank0.jsonl").read_text().splitlines()
    assert {json.loads(x)["step"] for x in lines} == {7}
    assert not (tmp_path / "rollouts" / "media" / "step_000008").exists()


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: handmade\nreward: {functions: [{name: genrm}]}\n")
    metrics = [
        {"step": 0, "eval/reward/mean": 0.1, "eval/reward/genrm": 0.1},
        {
            "step": 1,
            "reward/mean": 0.5,
            "reward/std": 0.3,
            "reward/genrm": 0.5,
            "reward/rule": 0.8,
            "timing/generate_s": 0.1,
            "timing/update_s": 0.2,
        },
        {
            "step": 2,
            "reward/mean": 0.6,
            "reward/std": 0.3,
            "reward/genrm": 0.6,
            "reward/rule": 0.8,
            "timing/generate_s": 0.1,
            "timing/update_s": 0.2,
        },
        {"step": 2, "eval/reward/mean": 0.3, "eval/reward/genrm": "nan"},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    write_rollouts(run, 0, 1, handmade_rollout(), cap=64)
    write_rollouts(run, 1, 2, handmade_rollout(), cap=4)
    return run


def test_load_run_gives_dataframes(tmp_path):
    run = load_run(make_run(tmp_path))
    assert run.name == "handmade"
    m = run.metrics
    assert list(m["step"]) == [0, 1, 2]  # the step-2 train and eval rows merged
    assert m.loc[2, "eval/reward/mean"] == 0.3 and pd.isna(m.loc[2, "eval/reward/genrm"])
    r = run.rollouts
    assert len(r) == 6 + 4 and set(r["rank"]) == {0, 1}
    assert run.judge_terms == ["genrm"] and run.check_terms == ["rule"]
    spread = run.group_spread()
    # step 1, group a: rewards 0.0, 0.2 -> population std 0.1
    a = spread[(spread["step"] == 1) & (spread["prompt_id"] == "a")].iloc[0]
    assert a["std"] == pytest.approx(0.1, abs=1e-6) and not a["flat"]
    d = run.disagreements()
    assert d.loc[0, "gap"] == pytest.approx(-1.0)  # sample 0: judge 0.0, rule 1.0
    assert isinstance(run.media(0), Image.Image)


def test_html_report_holds_every_logged_sample(tmp_path):
    run_dir = make_run(tmp_path)
    html = write_report(run_dir).read_text()
    check_report(html, load_run(run_dir))
    assert html.count("data:image/png;base64,") >= 10  # figures and samples inline
    assert 'src="http' not in html and "src='http" not in html  # self-contained


def check_report(html: str, run) -> None:
    """Every logged sample has a row with its reward, parts and verdicts as logged."""
    rows = re.findall(r'<tr class=sample id="s(\d+)">(.*?)</tr>', html, flags=re.S)
    assert len(rows) == len(run.rollouts)
    for idx, cells in rows:
        rec = run.rollouts.loc[int(idx)]
        values = dict(re.findall(r"data-k='?([^'>]+)'?>([^<]*)</td>", cells))
        assert float(values["reward"]) == pytest.approx(rec["reward"], abs=1e-4)
        for p in run.parts:
            assert float(values[f"part/{p}"]) == pytest.approx(rec[f"part/{p}"], abs=1e-4)
        for t in run.judge_terms:
            assert float(values[f"verdict/{t}"]) == pytest.approx(rec[f"verdict/{t}"], abs=1e-4)
            assert str(rec[f"raw/{t}"]) in cells


def test_requested_tracker_that_is_missing_names_the_install_command():
    missing = [m for m in ("wandb", "mlflow") if importlib.util.find_spec(m) is None]
    if not missing:
        pytest.skip("wandb and mlflow are both installed")
    with pytest.raises(ConfigError, match=r"logging.trackers.*pip install"):
        load_config(None, [f"logging.trackers=[tensorboard, {missing[0]}]"])
    load_config(None, ["logging.trackers=[]"])  # no tracker at all is fine


def log_to_trackers(tmp_path: Path, tracker: str):
    """A logger with one tracker: two steps of scalars, an eval grid, a rollout table."""

    cfg = load_config(None, [f"logging.trackers=[{tracker}]", "name=tracked"])
    logger = make_logger(cfg, tmp_path, enabled=True)
    logger.log(1, {"reward/mean": 0.25, "train/loss": 1.5})
    logger.log(2, {"reward/mean": 0.5, "train/loss": 1.0, "eval/reward/mean": float("nan")})
    logger.add_image("samples/eval", Image.new("RGB", (16, 8), (255, 0, 0)), 2)
    logger.log_rollouts(2, write_rollouts(tmp_path, 0, 2, handmade_rollout(), cap=4))
    logger.close()
    return cfg


def test_wandb_offline_gets_scalars_grids_and_the_rollout_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_to_trackers(tmp_path, "wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    tables = list(runs[0].rglob("rollouts_*.table.json"))
    assert tables, "no rollout table"
    table = json.loads(tables[0].read_text())
    assert len(table["data"]) == 4 and "verdicts" in table["columns"]
    assert list(runs[0].rglob("samples/eval_*.png"))


def test_mlflow_file_store_gets_scalars_grids_and_the_rollout_table(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    log_to_trackers(tmp_path, "mlflow")
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    [exp] = [e for e in client.search_experiments() if e.name == "mmyatt"]
    [run] = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.data.params["name"] == "tracked"
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "rollouts")}
    assert "rollouts/step_000002.json" in arts
    assert client.list_artifacts(run.info.run_id, "samples/eval")


def test_clips_and_record_media_are_logged(tmp_path):
    r = handmade_rollout()
    r.outputs = [[Image.new("RGB", (8, 8), (0, 9 * k, 0)) for k in range(3)] for _ in range(6)]
    r.records = [{"prompt": "p", "video": "clips/a.mp4"} for _ in range(6)]
    rows = write_rollouts(tmp_path, 1, 3, r, cap=2)
    assert rows[0]["media"] == {"video": "clips/a.mp4"}
    assert rows[0]["output_file"].endswith(".gif")
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "reward/mean": 0.1}\n')
    run = load_run(tmp_path)
    frames = run.media(0)
    assert isinstance(frames, list) and len(frames) == 3
    assert "data:image/gif;base64," in write_report(tmp_path).read_text()


def test_report_of_a_run_without_rollouts(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/reward/mean": 0.2}\n')
    html = write_report(tmp_path).read_text()
    assert "No rollouts logged" in html and "0.2000" in html


def test_placement_views_per_mode_and_switches(tmp_path):
    """Run.placement: steps and mean figures per mode the steps ran in (hand-worked);
    Run.placement_switches: where the mode changed, with auto's prediction there."""
    rows = [
        {
            "step": 1,
            "placement/mode": "shared",
            "placement/mode_id": 0.0,
            "placement/actual_step_s": 1.0,
            "placement/gen_s": 0.4,
        },
        {
            "step": 2,
            "placement/mode": "colocate",
            "placement/mode_id": 1.0,
            "placement/actual_step_s": 0.8,
            "placement/gen_s": 0.2,
            "placement/predicted_step_s": 0.7,
        },
        {
            "step": 3,
            "placement/mode": "colocate",
            "placement/mode_id": 1.0,
            "placement/actual_step_s": 0.6,
            "placement/gen_s": 0.3,
            "placement/predicted_step_s": 0.65,
        },
        {
            "step": 4,
            "placement/mode": "partial",
            "placement/mode_id": 2.0,
            "placement/actual_step_s": 0.5,
            "placement/gen_s": 0.35,
            "placement/predicted_step_s": 0.55,
            "placement/judge_calls": 4.0,
        },
        {"step": 4, "eval/reward": 0.5},  # an eval row of the same step merges in
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    p = run.placement().set_index("mode")
    assert list(p.index) == ["shared", "colocate", "partial"]
    assert p["steps"].tolist() == [1, 2, 1]
    assert p.loc["colocate", "actual_step_s"] == pytest.approx(0.7)
    assert p.loc["colocate", "gen_s"] == pytest.approx(0.25)
    assert p.loc["partial", "judge_calls"] == 4.0 and pd.isna(p.loc["shared", "judge_calls"])
    sw = run.placement_switches()
    assert sw["step"].tolist() == [1, 2, 4]
    assert sw["mode"].tolist() == ["shared", "colocate", "partial"]
    assert sw["predicted_step_s"].tolist()[1:] == [0.7, 0.55]
    assert pd.isna(sw["predicted_step_s"].iloc[0])
    empty = tmp_path / "none"
    empty.mkdir()
    assert load_run(empty).placement().empty and load_run(empty).placement_switches().empty


def test_metrics_frame_merges_a_step_and_is_not_fragmented():
    # 150 metric columns, a training row and an eval row of the same step, a non-number
    rows = [
        {"step": 1, **{f"m/{i}": float(i) for i in range(150)}, "note": "x"},
        {"step": 1, "eval/reward/mean": 0.5},
        {"step": 0, "eval/reward/mean": 0.25},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas' PerformanceWarning on a fragmented frame
        df = metrics_frame(rows)
    assert list(df["step"]) == [0, 1]
    assert list(df.columns[:2]) == ["step", "m/0"]
    assert df.loc[df.step == 1, "m/149"].item() == 149.0
    assert list(df["eval/reward/mean"]) == [0.25, 0.5]
    assert df["note"].isna().all()  # not a number: coerced to NaN
