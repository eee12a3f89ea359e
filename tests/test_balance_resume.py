"""Resume with ``placement.balance``: the balancer's measurements and fitted cost model
are run state, so a run resumed after its fitting steps plans with the model at once
(it does not measure again), and its weights are those of the uninterrupted run up to
summation order (which groups move and how the passes are cut follow measured times,
so the two runs may sum the same samples in another order). With records moved at
dispatch instead, the resumed run is the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_cli import TINY
from test_resume import CFG, assert_same_run, stop_and_resume, train_rows

from mmyatt.datasets.synthetic import write_jsonl

# 2 controllers, a checkpoint after step 2 (where stop_and_resume stops), balancing on
BALANCED = [*TINY, "distributed.nproc=2", "checkpoint.save_every=2", "placement.balance=true"]


# two 2-controller runs and a resume: 46 s on 2 cores, so it runs in make test-slow
@pytest.mark.slow
def test_resumed_balancer_keeps_its_model_and_the_weights_match(tmp_path):
    args = [*BALANCED, "placement.balance_fit_steps=2"]
    full, parts, _ = stop_and_resume(tmp_path, CFG, *args)
    rows = train_rows(parts)
    # steps 1-2 measure and fit; step 3, the resumed run's first, is planned by the model
    assert "balance/model_error" not in rows[2]
    assert "balance/model_error" in rows[3] and "balance/model_error" in rows[4]
    files = sorted(
        p.relative_to(full) for p in (full / "checkpoints" / "final").rglob("*.safetensors")
    )
    assert files
    for f in files:
        wa, wb = load_file(str(full / f)), load_file(str(parts / f))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)


# two 2-controller runs and a resume, like the balancer's: make test-slow
@pytest.mark.slow
def test_resume_with_records_lent_at_dispatch_equals_uninterrupted(tmp_path):
    """placement.balance_at=dispatch moves records for the step only: each rank's cursor
    is its own draws', so the resumed run is the uninterrupted one, bit for bit."""
    # prompts of 1 to 24 terms, so that the plan moves records
    recs = [{"prompt": "+".join(["1"] * (1 + i % 24)) + "=", "answer": "1"} for i in range(64)]
    data = write_jsonl(tmp_path / "terms.jsonl", recs)
    data_args = [f"data.train={data}", f"data.eval={data}", "model.max_prompt_tokens=64"]
    dispatch = ["data.shuffle=true", "data.prompts_per_step=8", "placement.balance_at=dispatch"]
    args = [*BALANCED, *data_args, *dispatch]
    full, parts, _ = stop_and_resume(tmp_path, CFG, *args)
    rows = train_rows(parts)
    assert sorted(rows) == [1, 2, 3, 4]
    moved = [rows[s]["balance/dispatch_moved"] for s in (1, 2, 3, 4)]
    assert moved[2] > 0 or moved[3] > 0, moved  # the resumed steps moved records too
    assert_same_run(full, parts)
