"""The benchmarks a user can run, written once: ``mmyatt bench NAME --out F.json``.

Each name maps to the function that measures it. Every figure the project reports comes
from one of these, and its committed JSON lives at ``results/bench/<name>.json`` (``-``
becomes ``_``). A result records the code revision and the date it was measured on.

The functions are named as ``module:function`` and imported when the bench runs, so that
``mmyatt --help`` does not load every bench's dependencies.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path

from mmyatt.bench.runs import ROOT, measured_on

log = logging.getLogger(__name__)

# every benchmark, in the order `mmyatt bench all` runs them
BENCHES: dict[str, str] = {
    "text-grpo": "mmyatt.bench.text_grpo:bench_text_grpo",
    "flow-grpo": "mmyatt.bench.flow:bench_flow_grpo",
    "flow-real": "mmyatt.bench.flow_real:bench_flow_real",
    "checkpoint": "mmyatt.bench.checkpoint:bench_checkpoint",
    "faults": "mmyatt.bench.faults:bench_faults",
    "genrm": "mmyatt.bench.genrm:bench_genrm",
    "data-sharding": "mmyatt.bench.data:bench_data_sharding",
    "engines": "mmyatt.bench.engines:bench_engines",
    "lora-sync": "mmyatt.bench.lora_sync:bench_lora_sync",
    "placement": "mmyatt.placement.bench:bench_placement",
    # after placement: calibrated from, and validated against, placement's measured figures
    "placement-sim": "mmyatt.placement.simulate:bench_placement_sim",
    "balance": "mmyatt.bench.balance:bench_balance",
    "async": "mmyatt.bench.async_bench:bench_async",
}
RESULTS = ROOT / "results" / "bench"


def bench_file(name: str) -> str:
    """The JSON file of benchmark ``name``: ``data-sharding`` -> ``data_sharding.json``."""
    return name.replace("-", "_") + ".json"


def run_bench(name: str, quick: bool = False, **kwargs) -> dict:
    """Measure benchmark ``name`` (``quick``: its small form, as the test suite runs it)."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHES)}")
    module, function = BENCHES[name].split(":")
    return getattr(importlib.import_module(module), function)(quick=quick, **kwargs)


def write_result(result: dict, out: str | Path) -> Path:
    """Write a bench's result with the revision and date it was measured on."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "measured_on": measured_on()}, indent=2) + "\n")
    return out


def run_all(out_dir: str | Path, quick: bool = False, names=tuple(BENCHES)) -> dict[str, Path]:
    """Run the benchmarks one after another, writing each one's JSON into ``out_dir`` as
    soon as it is measured. ``placement-sim`` reads the placement figures this call wrote
    (or, when placement is not among ``names``, the committed ones)."""
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    for name in names:
        t0 = time.perf_counter()
        log.info("bench %s ...", name)
        kwargs = {}
        if name == "placement-sim":
            kwargs["measured_path"] = written.get("placement", RESULTS / bench_file("placement"))
        result = run_bench(name, quick=quick, **kwargs)
        written[name] = write_result(result, out_dir / bench_file(name))
        log.info("bench %s: %.0f s -> %s", name, time.perf_counter() - t0, written[name])
    return written
