"""Several rewards, one number per sample: weights, optional per-reward z-score.

A term is either a rule (any name ``resolve_reward`` knows, scored per sample) or
``genrm`` (a judge asked about the whole batch through the judge client). Each term's
raw values are reported under its name so that a judged reward and a rule checking
the same property can be compared side by side (reward hacking shows as the two
diverging).

z-scoring (``zscore: true`` on a term) standardises that term over the samples this
controller scored in the call, before weighting, so rewards on different scales mix
without one dominating; it is local to the controller by design (no media or rewards
cross ranks), and a constant term becomes 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mmyatt.protocols import Reward
from mmyatt.rewards.genrm import GenRMReward
from mmyatt.rewards.rules import WeightedReward
from mmyatt.serving.client import JudgeClient


class RewardMixture:
    """Weighted terms, each a rule set or a judge (the ``Reward`` protocol, as each term is)."""

    def __init__(self, terms: Sequence[tuple[str, Reward, float, bool]]):
        """terms: (label, reward, weight, zscore)."""
        if not terms:
            raise ValueError("RewardMixture needs at least one term")
        self.terms = list(terms)
        # per sample of the last call: {term label: the judge's verdict} for GenRM terms
        # (question, raw answer, parsed P(Yes) or score; see GenRMReward._verdicts)
        self.last_verdicts: list[dict] = []
        latent = [t[0] for t in self.terms if t[1].reads_latents]
        if latent and len(latent) < len(self.terms):
            raise ValueError(
                f"rewards {latent} read latents, the others decoded outputs; one rollout "
                "gives one or the other (rewards/latent.py)"
            )
        self.reads_latents = bool(latent)  # every term reads latents: rollouts skip the decode

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[dict],
        judge_urls: Sequence[str] = (),
        api_key=None,
        client: dict | None = None,
    ):
        """``client``: keyword arguments of the judge client (``max_retries``, ...)."""
        terms, client_kwargs, client = [], dict(client or {}), None
        for i, spec in enumerate(specs):
            name, weight = spec["name"], float(spec.get("weight", 1.0))
            kwargs = dict(spec.get("kwargs") or {})
            zscore = bool(spec.get("zscore", False))
            if name == "genrm":
                if not judge_urls:
                    raise ValueError(
                        f"reward.functions[{i}] is 'genrm' but no judge is configured: set "
                        "reward.judge.model (servers started with the run) or reward.judge.urls"
                    )
                client = client or JudgeClient(list(judge_urls), api_key=api_key, **client_kwargs)
                source: Reward = GenRMReward(client, **kwargs)
            else:
                source = WeightedReward([{"name": name, "kwargs": kwargs}])
            label = name if name not in {t[0] for t in terms} else f"{name}#{i}"
            terms.append((label, source, weight, zscore))
        return cls(terms)

    @property
    def compares_groups(self) -> bool:
        """Some term's reward of a sample depends on the other samples of its group
        (placement partial then streams whole groups to the judge, not single samples)."""
        return any(source.compares_groups for _l, source, _w, _z in self.terms)

    @property
    def names(self) -> list[str]:
        """The keys of the parts dict every call returns (a controller with nothing to
        score still reports them, so all ranks sum the same metrics)."""
        names: list[str] = []
        for label, source, _w, _z in self.terms:
            names.append(label)
            if not isinstance(source, WeightedReward):
                names += [n for n in source.names if n != label]
        return names

    def __call__(self, outputs, records, prompt_ids=None) -> tuple[Tensor, dict[str, Tensor]]:
        total = torch.zeros(len(outputs), dtype=torch.float32)
        parts: dict[str, Tensor] = {}
        verdicts: list[dict] = [{} for _ in outputs]
        for label, source, weight, zscore in self.terms:
            values, extra = source(outputs, records, prompt_ids)
            for row, v in zip(verdicts, source.last_verdicts):  # judges only: rules give none
                row[label] = v
            values = values.float()
            parts[label] = values
            for k, v in extra.items():
                if k != label and not (isinstance(source, WeightedReward)):
                    parts[k] = v
            total = total + weight * (standardise(values) if zscore else values)
        self.last_verdicts = verdicts
        return total, parts


def standardise(x: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / std over the batch; 0 for a constant batch. NaN passes through."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    std = x.std()
    return (x - x.mean()) / (std + eps) if std > eps else x - x.mean()
