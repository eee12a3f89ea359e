"""The GenRM serving bench's side by side: two checkouts' judge serving in alternating
rounds (here this checkout against itself, which must come out near 1x)."""

from __future__ import annotations

import pytest

from mmyatt.bench.genrm import _arm, side_by_side
from mmyatt.bench.runs import ROOT


@pytest.mark.slow
def test_side_by_side_of_a_checkout_with_itself():
    result = side_by_side(ROOT, pairs=2, quick=True)
    assert [p["order"] for p in result["pairs"]] == [("baseline", "this"), ("this", "baseline")]
    for n in ("1", "32"):
        ratios = [p[f"ratio_{n}"] for p in result["pairs"]]
        assert result[f"median_ratio_{n}"] == pytest.approx(sum(ratios) / 2)
        for p in result["pairs"]:  # the ratio is of the two arms' figures of that pair
            figures = p["this"][f"req_per_s_{n}"], p["baseline"][f"req_per_s_{n}"]
            assert p[f"ratio_{n}"] == pytest.approx(figures[0] / figures[1])
            assert min(figures) > 0


@pytest.mark.slow
def test_an_arm_that_runs_another_checkouts_code_is_refused(tmp_path):
    # a "checkout" with no judge client of its own: the arm's imports fall through to
    # the installed package, and timing it would time this checkout against itself
    (tmp_path / "mmyatt" / "rewards").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="imported its judge client from"):
        _arm(tmp_path, 4, 4, 1)


def test_an_arm_that_cannot_import_says_what_is_missing(tmp_path):
    # a baseline checkout whose code needs a package this environment lacks (52d040b's
    # judge client needs httpx): the error names the module, not only "did not start"
    (tmp_path / "mmyatt" / "rewards").mkdir(parents=True)
    (tmp_path / "mmyatt" / "__init__.py").write_text("import mmyatt_missing_dependency\n")
    with pytest.raises(RuntimeError, match="No module named 'mmyatt_missing_dependency'.*pip"):
        _arm(tmp_path, 4, 4, 1)
