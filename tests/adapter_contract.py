"""The contract every policy adapter (text, VLM, flow) passes.

A test module for an adapter subclasses ``AdapterContract``, provides three methods and
names the capability protocols the adapter has (``capabilities``); pytest collects the
inherited tests. The adapter must have every member of the Policy protocol and of its
capabilities, and none of the other capabilities (the engine checks them with
``isinstance``, never ``hasattr``). Keep this file free of any modality.
"""

from __future__ import annotations

import torch

from mmyatt.protocols import (
    EMA,
    ClosedFormKL,
    DecoderFlops,
    FlowVelocity,
    LatentOutputs,
    MediaPrompts,
    Policy,
    PolicyWrapper,
    ReferenceKL,
    RolloutStats,
    Sampling,
    SupervisedPolicy,
    TokenPolicy,
    WholeWeights,
)
from mmyatt.rollout import Rollout
from mmyatt.step.batches import micro_batch_cost, row_widths, token_micro_batches

# every capability an adapter may have (RolloutStats, WholeWeights and PolicyWrapper are
# an engine's: no adapter has them)
CAPABILITIES = (
    TokenPolicy,
    MediaPrompts,
    DecoderFlops,
    ReferenceKL,
    ClosedFormKL,
    EMA,
    LatentOutputs,
    FlowVelocity,
    SupervisedPolicy,
    RolloutStats,
    WholeWeights,
    PolicyWrapper,
)


def declared(protocol: type) -> tuple[set[str], set[str]]:
    """(methods, attributes) a protocol and the protocols it extends declare."""
    methods: set[str] = set()
    attributes: set[str] = set()
    for base in protocol.__mro__:
        if base.__module__ == "typing" or not vars(base).get("_is_protocol"):
            continue
        for name, value in vars(base).items():
            if callable(value) and not name.startswith("_"):
                methods.add(name)
            elif isinstance(value, property):
                attributes.add(name)
        attributes |= set(vars(base).get("__annotations__", {}))
    return methods, attributes


class AdapterContract:
    group_size = 3
    atol = 1e-5
    capabilities: tuple[type, ...] = ()  # the capability protocols the adapter has

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

    def test_has_every_declared_member_of_its_capabilities_and_no_other_capability(self):
        policy = self.make_policy()
        for capability in CAPABILITIES:
            assert isinstance(policy, capability) == (capability in self.capabilities), (
                capability.__name__
            )
        for protocol in (Policy, *self.capabilities):
            methods, attributes = declared(protocol)
            assert methods or attributes, protocol.__name__
            for name in sorted(methods):
                assert callable(getattr(policy, name)), f"{protocol.__name__}.{name}"
            for name in sorted(attributes):
                assert name in dir(policy), f"{protocol.__name__}.{name}"

    def test_reference_logprobs(self):
        if ReferenceKL not in self.capabilities:
            return
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        policy.enable_reference()
        ref = policy.reference_logprobs(r)
        m = r.mask.bool()
        assert ref.shape == r.logprobs.shape and not ref.requires_grad
        assert torch.isfinite(ref[m]).all()

    def test_token_members_are_what_sampling_used(self):
        """A rollout engine other than the adapter's sampler (vLLM) reads these: the
        prompt ids it sends must be the rollout's, banned ids must never be sampled."""
        if TokenPolicy not in self.capabilities:
            return
        policy, prompts = self.make_policy(), self.make_prompts()
        r = self._rollout(policy, prompts)
        ids, attn = r.context["input_ids"], r.context["attention_mask"]
        P = ids.shape[1] - r.num_actions
        assert P == policy.max_prompt_tokens
        encoded = policy.encode_prompts(prompts)
        for i in range(len(r)):
            row = ids[i, :P][attn[i, :P].bool()].tolist()
            assert row == list(encoded[i // self.group_size]), i
        assert not torch.isin(r.actions[r.mask.bool()], policy.banned_tokens).any()
        vocab = max(len(policy.tokenizer), int(policy.banned_tokens.max()) + 1)
        tempered = policy.tempered(torch.zeros(2, vocab), 0.5)
        assert (tempered[:, policy.banned_tokens] == torch.finfo(torch.float32).min).all()
        kept = torch.ones(vocab, dtype=torch.bool)
        kept[policy.banned_tokens] = False
        assert (tempered[:, kept] == 0).all()
        assert policy.eos_ids and not set(policy.banned_tokens.tolist()) & policy.eos_ids

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
