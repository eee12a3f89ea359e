"""Resume with ``placement.balance``: the balancer's measurements and fitted cost model
are run state, so a run resumed after its fitting steps plans with the model at once
(it does not measure again), and its weights are those of the uninterrupted run up to
summation order (which groups move and how the passes are cut follow measured times,
so the two runs may sum the same samples in another order)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_cli import TINY
from test_resume import CFG, stop_and_resume, train_rows


# two 2-controller runs and a resume: 46 s on 2 cores, so it runs in make test-slow
@pytest.mark.slow
def test_resumed_balancer_keeps_its_model_and_the_weights_match(tmp_path):
    args = [
        *TINY,
        "distributed.nproc=2",
        "checkpoint.save_every=2",
        "placement.balance=true",
        "placement.balance_fit_steps=2",
    ]
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
