"""Merge the rounds of two placement-bench JSONs of one drifting workload (two
invocations of the same command, e.g. 4 rounds each) into one JSON, and derive the
acceptance figures again over all rounds. Per-round figures are concatenated and each
mean is taken again; an arm's other details are the first file's.

    .venv/bin/python bench/placement_merge_rounds.py drifting A.json B.json OUT.json
"""

import json
import statistics
import sys
from pathlib import Path

from mmyatt.placement.bench_figures import DRIFTING, MODES, _derive


def merge(wl: str, a: dict, b: dict) -> dict:
    if wl not in DRIFTING:
        raise SystemExit(f"only the drifting workloads {DRIFTING} are merged, not {wl!r}")
    out = {k: v for k, v in a.items() if k in ("machine", "cores", "controllers")}
    arms: dict = {}
    for m in MODES:
        x, y = a[wl][m], b[wl][m]
        arm = dict(x)
        arm["total_s_per_round"] = x["total_s_per_round"] + y["total_s_per_round"]
        arm["total_s"] = statistics.fmean(arm["total_s_per_round"])
        for seg in (k for k in x if k.startswith("segment_")):
            s = dict(x[seg])
            s["step_s_per_round"] = x[seg]["step_s_per_round"] + y[seg]["step_s_per_round"]
            s["step_s"] = statistics.fmean(s["step_s_per_round"])
            s["modes_run_per_round"] = x[seg]["modes_run_per_round"] + y[seg]["modes_run_per_round"]
            arm[seg] = s
        arms[m] = arm
    arms["rounds"] = a[wl]["rounds"] + b[wl]["rounds"]
    arms["steps_per_run"] = a[wl]["steps_per_run"]
    if b[wl]["steps_per_run"] != arms["steps_per_run"]:
        raise SystemExit("the two files ran different numbers of steps per run")
    out[wl] = arms
    out["merged_from_rounds"] = [a[wl]["rounds"], b[wl]["rounds"]]
    _derive(out)
    return out


if __name__ == "__main__":
    wl, fa, fb, fo = sys.argv[1:5]
    res = merge(wl, json.loads(Path(fa).read_text()), json.loads(Path(fb).read_text()))
    Path(fo).write_text(json.dumps(res, indent=2) + "\n")
    print({k: v for k, v in res.items() if k.startswith("auto_over") or k.endswith("_per_segment")})
