import pytest
import torch

from mmyatt.rewards.mixture import RewardMixture, standardise


def test_weights_zscore_and_parts():
    mix = RewardMixture.from_specs(
        [
            {"name": "exact_match", "weight": 2.0},
            {"name": "format_check", "weight": 1.0, "zscore": True},
        ]
    )
    recs = [{"answer": "4"}, {"answer": "4"}, {"answer": "4"}]
    total, parts = mix(["4", "x", "5"], recs)
    # exact: [1, 0, 0]; format (digits): [1, 0, 1] -> mean 2/3, std (unbiased) = sqrt(1/3)
    fmt = torch.tensor([1.0, 0.0, 1.0])
    z = (fmt - 2 / 3) / (fmt.std() + 1e-6)
    torch.testing.assert_close(total, 2 * torch.tensor([1.0, 0.0, 0.0]) + z)
    torch.testing.assert_close(parts["format_check"], fmt)  # raw values are reported


def test_constant_term_standardises_to_zero():
    torch.testing.assert_close(standardise(torch.tensor([3.0, 3.0, 3.0])), torch.zeros(3))


def test_genrm_without_judge_is_a_clear_error():
    with pytest.raises(ValueError, match="no judge is configured"):
        RewardMixture.from_specs([{"name": "genrm"}])
