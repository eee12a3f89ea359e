"""Balanced controllers in the step (``placement.balance``): after advantages, each
minibatch's prompt groups may change controller, as the step's plan says
(``balancer.py``: from the cost model of what each rank's update runs, or with
``balance_when: always`` Karmarkar-Karp on token counts, ``balance.py``); the groups
that change rank travel as tensors over the process group (point-to-point sends, gloo
on CPU). Groups move whole: the policy runs a group's prompt once for all its samples,
and a group split over two ranks would run it on both.

What travels: the token / latent tensors a sample trains on (actions, sampling
log-probs, mask, the adapter's tensor context such as ``input_ids`` / latents,
advantages, rewards) and its prompt id. What never travels: media and decoded outputs
(``outputs``, ``records``); a received sample has none (the rollout log and metrics use
each rank's own samples, before the exchange).

Minibatch j of the balanced step holds exactly the samples that minibatch j of every
rank held before (only their rank changes), and the gradient all-reduce sums over all
ranks, so the update is the one without balancing, up to summation order
(tests/test_placement_exchange.py). Every rank runs the same number of minibatches and,
with an equal-size partition, the same number of groups in each.

Text contexts of different prompt widths are joined by left-padding ``input_ids`` /
``attention_mask`` (masked columns: positions come from the mask); action tensors have
the same width on every rank (the token budget, the denoising schedule). A VLM sample
moves with its vision features, never its pixels: before the exchange every rank runs
its frozen vision tower once over its own media (``VLMPolicy.encode_media``), and the
samples train on those features wherever they land.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as tdist

from mmyatt.placement.balance import assign_parts, choose_parts, sample_cost
from mmyatt.placement.balancer import Balancer, Plan, Settings
from mmyatt.rollout import Rollout

LEFT_PADDED = ("input_ids", "attention_mask")  # text context: prompt left-padded


def group_costs(r: Rollout | None, kind: str) -> list[float]:
    """Training work per prompt group of ``r`` (cost model of balance.py), in group
    order: text tokens for text, the prompt counted once (the policy runs a group's
    prompt once and each completion after it) and every completion; trained denoising
    transitions for flow models."""
    if r is None or len(r) == 0:
        return []
    if kind == "flow":
        per = r.mask.sum(1)
        return [sample_cost(transitions=float(per[sl].sum())) for sl in r.group_slices()]
    attn = r.context.get("attention_mask")
    completion = r.mask.sum(1)
    prompt = attn[:, : attn.shape[1] - r.num_actions].sum(1) if attn is not None else None
    media = r.context.get("media") if kind == "vlm" else None
    out = []
    for sl in r.group_slices():
        tokens = float(completion[sl].sum()) + (
            float(prompt[sl].max()) if prompt is not None else 0
        )
        # a VLM prompt's placeholder tokens are its vision tokens (one feature row each)
        vision = float(_vision_rows(media[sl.start])) if media is not None else 0.0
        out.append(sample_cost(text_tokens=tokens - vision, vision_tokens=vision))
    return out


def _vision_rows(m: dict) -> int:
    return sum(len(m[k]) for k in ("image_embeds", "video_embeds") if m.get(k) is not None)


def token_plan(costs: list[float], owner: list[int], P: int) -> list[int]:
    """``balance_when: always``: each group's rank from Karmarkar-Karp on token counts
    (``choose_parts``), each part where most of it already is (``assign_parts``)."""
    parts = choose_parts(costs, owner, P)
    rank_of = assign_parts(parts, owner, P)
    dest = [0] * len(costs)
    for p, items in enumerate(parts):
        for g in items:
            dest[g] = rank_of[p]
    return dest


class Exchange:
    """Plans (``Balancer``) and carries out the move of whole prompt groups between the
    controllers."""

    def __init__(self, dist, kind: str, settings: Settings | None = None):
        self.dist, self.kind = dist, kind
        self.balancer = Balancer(dist, kind, settings or Settings(when="always"), token_plan)
        self.sizes: list[int] | None = None  # samples per minibatch on this rank, after

    def plan(self, minibatches: list[Rollout | None]) -> Plan:
        """Where every group trains this step, decided on rank 0 and the same everywhere."""
        return self.balancer.plan(minibatches, [group_costs(mb, self.kind) for mb in minibatches])

    def apply(self, minibatches: list[Rollout | None], plan: Plan) -> Rollout | None:
        """This rank's samples after ``plan`` moved the groups (minibatches concatenated;
        ``self.sizes`` gives their lengths)."""
        me = self.dist.rank
        send: dict[int, list[list[int]]] = {}  # dest -> per minibatch, local rows
        recv_from: dict[int, list[int]] = {}  # src -> per minibatch, groups expected
        keep: list[list[int]] = []
        for j, mb in enumerate(minibatches):
            slices = mb.group_slices() if mb is not None else []
            owner, mine = plan.owner[j], []
            index = [owner[:g].count(owner[g]) for g in range(len(owner))]  # within its rank
            for g, dest in enumerate(plan.dest[j]):
                src = owner[g]
                if src == me:
                    rows = list(range(slices[index[g]].start, slices[index[g]].stop))
                    if dest == me:
                        mine += rows
                    else:
                        send.setdefault(dest, [[] for _ in minibatches])[j].extend(rows)
                elif dest == me:
                    recv_from.setdefault(src, [0] * len(minibatches))[j] += 1
            keep.append(sorted(mine))
        received = self._transfer(minibatches, send, recv_from)
        out, self.sizes = [], []
        for j, mb in enumerate(minibatches):
            pieces = [mb.select(keep[j])] if mb is not None and keep[j] else []
            pieces += [received[src][j] for src in sorted(received) if received[src][j]]
            part = concat_padded(pieces) if pieces else None
            self.sizes.append(len(part) if part is not None else 0)
            if part is not None:
                out.append(part)
        return concat_padded(out) if out else None

    def split(self, r: Rollout | None) -> list[Rollout | None]:
        """The balanced rollout back into its minibatches."""
        out, start = [], 0
        for n in self.sizes or []:
            out.append(r.select(list(range(start, start + n))) if n else None)
            start += n
        return out

    def _transfer(self, minibatches, send, recv_from) -> dict[int, list[Rollout | None]]:
        """Point-to-point: one message per (source, destination) pair, a size then the
        bytes of the samples' tensors."""
        reqs, keep_alive = [], []
        dev = self.dist.device  # NCCL sends device tensors only; gloo the CPU's
        for dest in sorted(send):
            payload = [
                _pack(mb.select(rows)) if rows else None
                for mb, rows in zip(minibatches, send[dest])
            ]
            buf = io.BytesIO()
            torch.save(payload, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(dev)
            size = torch.tensor([data.numel()], dtype=torch.long, device=dev)
            keep_alive += [data, size]
            reqs += [tdist.isend(size, dest), tdist.isend(data, dest)]
        got = {}
        for src in sorted(recv_from):
            size = torch.zeros(1, dtype=torch.long, device=dev)
            tdist.recv(size, src)
            data = torch.empty(int(size), dtype=torch.uint8, device=dev)
            tdist.recv(data, src)
            payload = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
            got[src] = [_unpack(p) if p is not None else None for p in payload]
        for q in reqs:
            q.wait()
        return got


MEDIA = ("pixel_values", "pixel_values_videos")  # what never leaves its controller


def _pack(r: Rollout) -> dict:
    """The tensors a sample trains on (no outputs, records or media; a VLM sample's
    vision features, which ``encode_media`` put in place of its pixels)."""
    ctx = {k: v.cpu() for k, v in r.context.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in r.context.items() if isinstance(v, int | float)}
    if (media := r.context.get("media")) is not None:
        if any(m.get(k) is not None for m in media for k in MEDIA):
            raise RuntimeError(
                "placement.balance moves vision features, never pixels: encode the "
                "rollout's media first (VLMPolicy.encode_media)"
            )
        ctx["media"] = media  # per-sample dicts; a group's samples share one (sent once)
    out = {
        "prompt_ids": list(r.prompt_ids),
        "actions": r.actions.cpu(),
        "logprobs": r.logprobs.cpu(),
        "mask": r.mask.cpu(),
        "context": ctx,
        "scalars": scalars,
    }
    for k in ("truncated", "rewards", "advantages", "ref_logprobs"):
        v = getattr(r, k)
        if v is not None:
            out[k] = v.cpu()
    return out


def _unpack(d: dict) -> Rollout:
    n = len(d["prompt_ids"])
    return Rollout(
        prompt_ids=d["prompt_ids"],
        actions=d["actions"],
        logprobs=d["logprobs"],
        mask=d["mask"],
        context={**d["context"], **d["scalars"]},
        outputs=[None] * n,
        records=[{} for _ in range(n)],
        truncated=d.get("truncated"),
        rewards=d.get("rewards"),
        advantages=d.get("advantages"),
        ref_logprobs=d.get("ref_logprobs"),
    )


def concat_padded(parts: list[Rollout]) -> Rollout:
    """``Rollout.concat`` after left-padding the text context's ``input_ids`` /
    ``attention_mask`` to the widest part (masked columns); action tensors must agree.
    Outputs, records and reward parts are dropped (received samples have none)."""
    parts = [p for p in parts if p is not None and len(p)]
    if len(parts) == 1:
        return parts[0]

    keys = [k for k in LEFT_PADDED if k in parts[0].context]
    widths = {k: max(p.context[k].shape[1] for p in parts) for k in keys}
    fixed = []
    for p in parts:
        ctx = dict(p.context)
        for k in keys:
            t = ctx[k]
            if t.shape[1] < widths[k]:
                ctx[k] = torch.cat([t.new_zeros(t.shape[0], widths[k] - t.shape[1]), t], 1)
        fixed.append(
            p.with_(
                context=ctx,
                reward_parts={},
                verdicts=None,
                outputs=[None] * len(p),
                records=[{} for _ in range(len(p))],
            )
        )
    return Rollout.concat(fixed)
