"""A tiny policy for engine tests: one learnable logit vector per prompt-agnostic arm set.

Each sample is a single action (an arm index); the output is the arm as a string. It
implements the Policy protocol in ~40 lines, so engine behaviour (dynamic sampling,
minibatches, distributed sums) can be tested without a language model.
"""

from __future__ import annotations

import torch
from torch import nn

from mmyatt.protocols import Sampling, seeded_generator
from mmyatt.rollout import Rollout


class BanditPolicy:
    def __init__(self, arms: int = 4, seed: int = 0):
        torch.manual_seed(seed)
        self.net = nn.Linear(1, arms)
        self.reference = None

    def _logits(self, n: int) -> torch.Tensor:
        return self.net(torch.ones(n, 1))

    def generate(self, prompts, group_size, sampling: Sampling, seeds) -> Rollout:
        acts, recs, ids = [], [], []
        with torch.no_grad():
            probs = torch.softmax(self._logits(1)[0] / sampling.temperature, -1)
        for rec, seed in zip(prompts, seeds):
            g = seeded_generator(seed)
            if sampling.greedy:
                a = probs.argmax().repeat(group_size)
            else:
                a = torch.multinomial(probs, group_size, replacement=True, generator=g)
            acts.append(a)
            recs += [rec] * group_size
            ids += [str(rec.get("id", rec.get("_index")))] * group_size
        actions = torch.cat(acts)[:, None]
        r = Rollout(
            ids,
            actions,
            torch.zeros(len(ids), 1),
            torch.ones(len(ids), 1),
            {},
            [str(int(a)) for a in actions[:, 0]],
            recs,
            torch.zeros(len(ids), dtype=torch.bool),
        )
        with torch.no_grad():
            r.logprobs = self.logprobs(r)
        return r

    def logprobs(self, rollout, with_entropy=False):
        logp = torch.log_softmax(self._logits(len(rollout)), -1)
        lp = logp.gather(1, rollout.actions)
        if with_entropy:
            ent = -(logp.exp() * logp).sum(-1, keepdim=True)
            return lp, ent
        return lp

    def module(self):
        return self.net

    def save(self, path):
        import os

        os.makedirs(path, exist_ok=True)
        torch.save(self.net.state_dict(), os.path.join(path, "bandit.pt"))

    def enable_reference(self):
        import copy

        self.reference = copy.deepcopy(self.net)

    def reference_logprobs(self, rollout):
        with torch.no_grad():
            logp = torch.log_softmax(self.reference(torch.ones(len(rollout), 1)), -1)
        return logp.gather(1, rollout.actions)
