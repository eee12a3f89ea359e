"""The contract every policy adapter (text, VLM, flow) passes.

A test module for an adapter subclasses ``AdapterContract`` and provides three
methods; pytest collects the inherited tests. Keep this file free of any modality.
"""

from __future__ import annotations

import torch

from mmyatt.protocols import Policy, Sampling
from mmyatt.rollout import Rollout
from mmyatt.step.batches import micro_batch_cost, row_widths, token_micro_batches


class AdapterContract:
    group_size = 3
    atol = 1e-5

    # --- to provide -------------------------------------------------------------
    def make_policy(self) -> Policy:  # a tiny, seeded policy
        raise NotImplementedError

    def make_prompts(self) -> list[dict]:  # at least two manifest records
        raise NotImplementedError

    def load_policy(self, path: str) -> Policy:  # the adapter's loader for `save` output
        raise NotImplementedError

    def sampling(self) -> Sampling:
        return Sampling(temperature=1.0, max_new_tokens=8)

    # --- the contract -------------------------------------------------------------
    def _rollout(self, policy, prompts, seeds=None) -> Rollout:
        seeds = seeds if seeds is not None else [11 * (i + 1) for i in range(len(prompts))]
        return policy.generate(prompts, self.group_size, self.sampling(), seeds)

    def test_is_policy(self):
        assert isinstance(self.make_policy(), Policy)

    def test_rollout_shapes(self):
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        n = len(prompts) * self.group_size
        assert len(r) == n and len(r.outputs) == n and len(r.records) == n
        assert r.logprobs.shape == r.mask.shape == r.actions.shape[:2]
        assert r.logprobs.dtype == torch.float32
        assert set(r.mask.unique().tolist()) <= {0.0, 1.0}
        assert torch.isfinite(r.logprobs[r.mask.bool()]).all()
        assert [s.stop - s.start for s in r.group_slices()] == [self.group_size] * len(prompts)

    def test_seeded_and_rank_invariant(self):
        policy, prompts = self.make_policy(), self.make_prompts()
        a = self._rollout(policy, prompts, seeds=[5, 7])
        b = self._rollout(policy, prompts, seeds=[5, 7])
        assert torch.equal(a.actions, b.actions)
        # the second prompt's group does not depend on what else is in the batch
        alone = self._rollout(policy, prompts[1:2], seeds=[7])
        g = self.group_size
        assert torch.allclose(a.actions[g : 2 * g].float(), alone.actions.float(), atol=1e-4)
        c = self._rollout(policy, prompts, seeds=[6, 8])
        assert not torch.equal(a.actions, c.actions)

    def test_recomputed_logprobs_match_sampling(self):
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        with torch.no_grad():
            lp = policy.logprobs(r)
        m = r.mask.bool()
        assert lp.shape == r.logprobs.shape
        ratio = torch.exp(lp[m] - r.logprobs[m])
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=self.atol), ratio

    def test_micro_batches_give_the_batch_logprobs(self):
        # algorithm.micro_batch_tokens and minibatches score row subsets: each row's
        # log-probs and entropy must not depend on which other rows share its pass
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        prompt, action = row_widths(r)
        budget = micro_batch_cost(r, list(range(len(r))), prompt, action) // 2
        parts = token_micro_batches(r, budget)
        assert len(parts) >= 2 and sorted(sum(parts, [])) == list(range(len(r)))
        with torch.no_grad():
            lp, ent = policy.logprobs(r, with_entropy=True)
            for rows in parts:
                lp_part, ent_part = policy.logprobs(r.select(rows), with_entropy=True)
                m = r.mask[rows].bool()
                assert torch.allclose(lp_part[m], lp[rows][m], atol=self.atol)
                assert torch.allclose(ent_part[m], ent[rows][m], atol=self.atol)

    def test_logprobs_are_differentiable(self):
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        lp = policy.logprobs(r)
        (lp * r.mask).sum().backward()
        grads = [p.grad for p in policy.module().parameters() if p.requires_grad]
        assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)

    def test_entropy(self):
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        with torch.no_grad():
            lp, ent = policy.logprobs(r, with_entropy=True)
        assert ent.shape == lp.shape
        assert torch.isfinite(ent[r.mask.bool()]).all()

    def test_save_load_round_trip(self, tmp_path):
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        policy.save(str(tmp_path / "export"))
        loaded = self.load_policy(str(tmp_path / "export"))
        with torch.no_grad():
            a, b = policy.logprobs(r), loaded.logprobs(r)
        m = r.mask.bool()
        assert torch.allclose(a[m], b[m], atol=1e-6)
