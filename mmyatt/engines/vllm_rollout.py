"""``rollout.backend: vllm``: rollouts from an in-process vLLM engine per controller.

Each controller owns one ``vllm.LLM`` on its own device, built from the policy's model
directory. Before a generation whose trainer weights changed (an optimizer step moved
them), the engine gets them (``sync_weights``): a full fine-tune's whole weights, loaded
in place; a LoRA policy's adapter alone, the engine holding the base weights and serving
the adapter through vLLM's LoRA support (:mod:`mmyatt.engines.vllm_lora`). Each sync logs
``sync/bytes`` (the tensors sent) and ``sync/seconds``. Around training the engine sleeps
(``LLM.sleep`` / ``wake_up``, GPU only: it frees the KV cache and, at level 2, the
weights; a LoRA policy's base weights are sent again after a level-2 wake). vLLM's sleep
mode needs a GPU: on the CPU backend ``rollout.sleep_level`` must be 0 (an error names
the fix).

Samples come back with the engine's per-token log-probs (``logprobs_mode=
processed_logprobs``: after temperature and the banned-token mask, the same tempered
distribution the trainer scores; with top_p < 1 vLLM renormalises over the nucleus
and the trainer does not, which the correction below absorbs). The trainer then
scores the same tokens; its log-probs become the rollout's ``logprobs`` (the PPO
ratio starts at 1 on the trainer's numerics) and the mismatch is corrected by
truncated importance sampling (TIS, as verl and the "Your efficient RL framework
secretly brings you off-policy RL training" note): each token's loss is weighted by

    w = min(exp(logp_trainer - logp_engine), C)      (C = rollout.is_cap; 0 turns it off)

stored as ``context["is_weight"]`` (the controller multiplies the per-token loss by
it). Logged per step: ``rollout/logprob_diff`` (mean |logp_trainer - logp_engine| over
kept tokens), ``rollout/is_weight_mean``, ``rollout/is_weight_max``,
``rollout/is_weight_clipped_frac``, and the engine's ``rollout/weight_sync_s``,
``rollout/sleep_s``, ``rollout/wake_s``.

Over-dispatch (``rollout.over_dispatch_ratio``: stop once the batch's groups are
complete, abort the rest) and partial's streaming (each group to the judge as it
finishes) run the engine's step loop instead of ``generate``
(:mod:`mmyatt.engines.vllm_steps`).

Text and VLM policies: a VLM's images and video go to the engine as
``multi_modal_data`` with the prompt's expanded token ids (:mod:`mmyatt.engines.vllm_vlm`).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from mmyatt.engines.install import OPEN, require
from mmyatt.engines.vllm_lora import AdapterSync, lora_engine_args, tensor_bytes
from mmyatt.engines.vllm_steps import stepped_generate
from mmyatt.engines.vllm_vlm import (
    attach_media,
    check_prompt_ids,
    cpu_torchvision_compat,
    is_vlm,
    mm_limits,
    vlm_requests,
)
from mmyatt.engines.wrapper import WrappedPolicy
from mmyatt.protocols import LoRAPolicy, Policy, TokenPolicy, adapter_of
from mmyatt.rollout import Rollout, prompt_id

IS_KEYS = ("is_abs_diff_sum", "is_weight_sum", "is_clipped_sum")


def truncated_is_weights(
    trainer_lp: Tensor, engine_lp: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token TIS weights ``min(exp(trainer - engine), cap)`` (1 where masked, and
    everywhere when ``cap`` is 0), and per-sample sums for the step's metrics:
    ``is_abs_diff_sum`` (of |trainer - engine|), ``is_weight_sum`` (of the weights before
    the cap), ``is_clipped_sum`` (tokens whose weight hit the cap), over kept tokens."""
    keep = mask.bool()
    diff = torch.where(keep, trainer_lp.float() - engine_lp.float(), 0.0)
    raw = torch.where(keep, diff.exp(), 1.0)
    w = raw.clamp(max=cap) if cap > 0 else torch.ones_like(raw)
    w = torch.where(keep, w, 1.0)
    sums = {
        "is_abs_diff_sum": diff.abs().sum(1),
        "is_weight_sum": torch.where(keep, raw, 0.0).sum(1),
        "is_clipped_sum": ((raw > cap) & keep).float().sum(1) if cap > 0 else torch.zeros(len(w)),
    }
    return w, sums


def is_metrics(r: Rollout, dist) -> dict[str, float]:
    """The step's TIS figures from the per-sample sums in ``r.context`` (all ranks)."""
    local = {k: float(r.context[k].sum()) for k in IS_KEYS if k in r.context}
    if not local:
        return {}
    local["tokens"] = float(r.mask.sum())
    g = dist.sum_many(local)
    n = max(g["tokens"], 1.0)
    return {
        "rollout/logprob_diff": g["is_abs_diff_sum"] / n,
        "rollout/is_weight_mean": g["is_weight_sum"] / n,
        "rollout/is_weight_clipped_frac": g["is_clipped_sum"] / n,
    }


def completion_texts(policy: TokenPolicy, tokens: list[list[int]], A: int) -> list[str]:
    """The completions' text, each cut at the token budget ``A``: a rollout's ``outputs``,
    and what partial's stream sends the judge before the rollout exists."""
    return policy.tokenizer.batch_decode([list(t)[:A] for t in tokens], skip_special_tokens=True)


def engine_samples_to_rollout(
    policy: TokenPolicy,
    prompts: list[dict],
    prompt_ids: list[list[int]],
    samples,
    group_size: int,
    A: int,
) -> Rollout:
    """A rollout in exactly the adapter's layout (see TextPolicy.generate) from engine
    samples: ``samples[i]`` is prompt ``i // G``'s ``i % G``-th sample, a tuple
    ``(token_ids, logprobs, stopped)``."""
    G = group_size
    P = policy.max_prompt_tokens
    N = len(prompts) * G
    pad = policy.pad_id
    prompt = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros(N, P, dtype=torch.long)
    actions = torch.full((N, A), pad, dtype=torch.long)
    logprobs = torch.zeros(N, A)
    mask = torch.zeros(N, A)
    stopped = torch.zeros(N, dtype=torch.bool)
    for i, (tokens, lps, stop) in enumerate(samples):
        ids = prompt_ids[i // G]
        prompt[i, P - len(ids) :] = torch.tensor(ids)
        pmask[i, P - len(ids) :] = 1
        n = min(len(tokens), A)
        actions[i, :n] = torch.tensor(tokens[:n], dtype=torch.long)
        logprobs[i, :n] = torch.tensor(lps[:n], dtype=torch.float32)
        mask[i, :n] = 1.0
        stopped[i] = bool(stop)
    outputs = completion_texts(policy, [tokens for tokens, _, _ in samples], A)
    return Rollout(
        prompt_ids=[prompt_id(r, i) for i, r in enumerate(prompts) for _ in range(G)],
        actions=actions,
        logprobs=logprobs,
        mask=mask,
        context={
            "input_ids": torch.cat([prompt, actions], 1),
            "attention_mask": torch.cat([pmask, mask.long()], 1),
        },
        outputs=outputs,
        records=[r for r in prompts for _ in range(G)],
        truncated=~stopped,
    )


class VLLMRolloutPolicy(WrappedPolicy):
    """The controller's policy with generation on vLLM (see the module docstring); the
    ``RolloutStats`` capability. Everything but generation is ``inner``'s (the training
    engine's policy). ``llm`` may be given (tests pass an object with vLLM's
    ``generate`` interface).

    The options are the run config's ``rollout.*`` keys of the same names (and
    defaults): ``sleep_level`` (0, 1 or 2: how deep the engine sleeps during training;
    0 stays awake), ``gpu_memory_utilization`` (the device share its KV cache may take)
    and ``is_cap`` (the TIS cap C; 0 turns the correction off)."""

    def __init__(
        self,
        inner: Policy,
        engine,
        dist,
        *,
        model_path=None,
        llm=None,
        sleep_level: int = 1,
        gpu_memory_utilization: float = 0.4,
        is_cap: float = 2.0,
    ):
        super().__init__(inner)
        self._engine, self.dist = engine, dist
        self.sleep_level = sleep_level
        self.gpu_memory_utilization = gpu_memory_utilization
        self.is_cap = is_cap
        self.model_path = model_path
        self._llm = llm
        self._synced = None if llm is None else self._version()
        self._asleep = False
        self.timings: dict[str, float] = {}
        # a LoRA policy (models/lora.py) syncs its adapter only; None: full weights
        adapter = self._adapter()
        lora = adapter.lora if isinstance(adapter, LoRAPolicy) else None
        self._lora = None if lora is None else AdapterSync(lora)
        if self._lora is not None:  # a given engine holds the base, not yet the adapter
            self._synced = None
        self._base_lost = False  # a LoRA engine woke from level-2 sleep without weights
        if self._lora is not None and getattr(engine, "name", None) == "megatron":
            raise ValueError(
                "model.lora.rank > 0 with rollout.backend=vllm: train.backend=megatron "
                "holds no LoRA adapter; use train.backend=replica or fsdp2"
            )

    # ------------------------------------------------------------------ engine
    def _adapter(self) -> TokenPolicy:
        """The text or VLM adapter under any engine wrappers (prompts, pad, bans)."""
        return adapter_of(self._inner)

    def llm(self):
        if self._llm is None:
            require("vllm", "rollout.backend=vllm")
            cpu_torchvision_compat()  # before vllm imports torchvision (CPU torch only)
            import vllm

            # the trainer's dtype: vLLM's "auto" turns float32 checkpoints into 16-bit
            dtype = str(next(self._inner.module().parameters()).dtype).replace("torch.", "")
            from vllm.platforms import current_platform

            if self.sleep_level > 0 and not current_platform.is_sleep_mode_available():
                raise ValueError(
                    f"rollout.sleep_level={self.sleep_level}: vLLM's sleep mode needs a "
                    f"GPU, and this vLLM runs on {current_platform.device_type or 'the CPU'}; "
                    "set rollout.sleep_level=0 (the engine stays awake during training)"
                )
            extra = {"limit_mm_per_prompt": mm_limits()} if is_vlm(self._adapter()) else {}
            if self._lora is not None:
                extra.update(lora_engine_args(self._lora.lora))
            self._llm = vllm.LLM(
                model=str(self.model_path),
                dtype=dtype,
                seed=0,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_sleep_mode=self.sleep_level > 0,
                logprobs_mode="processed_logprobs",
                enforce_eager=True,
                **extra,
            )
            self._synced = None
            OPEN.append(self)
        return self._llm

    def close(self) -> None:
        """Shut the engine down (before the process group it uses is destroyed)."""
        llm, self._llm = self._llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        if self._lora is not None:
            self._lora.close()

    def _can_sleep(self) -> bool:
        return self.sleep_level > 0 and torch.cuda.is_available()

    def _version(self) -> tuple:
        return tuple(p._version for p in self._inner.module().parameters())

    def sync_weights(self) -> None:
        """Trainer weights -> the engine when an optimizer step moved them: the full
        weights in place, or a LoRA policy's adapter as a new adapter version."""
        version = self._version()
        if self._synced == version:
            return
        t0 = time.perf_counter()
        llm = self.llm()
        if self._lora is None:
            nbytes = _load_full(llm, self._engine.full_weights(self._inner))
        else:
            nbytes = 0
            if self._base_lost:  # level-2 sleep dropped the base weights the adapter needs
                nbytes += _load_full(llm, self._adapter().base_model_weights())
                self._base_lost = False
            nbytes += self._lora.push(llm, self._adapter())
        _reset_caches(llm)
        self._synced = version
        seconds = time.perf_counter() - t0
        self.timings["rollout/weight_sync_s"] = seconds
        self.timings["sync/seconds"] = seconds
        self.timings["sync/bytes"] = float(nbytes)

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts, group_size, sampling, seeds) -> Rollout:
        policy = self._adapter()
        vlm = is_vlm(policy)
        if not vlm and any(
            r.get("image") is not None or r.get("video") is not None for r in prompts
        ):
            raise ValueError(
                "rollout.backend=vllm: image/video prompts need a VLM policy (model.kind=vlm); "
                f"{type(policy).__name__} reads text only"
            )
        llm = self.llm()
        if self._can_sleep() and self._asleep:
            t0 = time.perf_counter()
            llm.wake_up()
            self._asleep = False
            if self.sleep_level == 2:  # the weights were dropped: send them again
                self._synced = None
                self._base_lost = self._lora is not None
            self.timings["rollout/wake_s"] = time.perf_counter() - t0
        self.sync_weights()
        if vlm:  # media read here, by the controller that owns the records
            requests, prompt_ids, media = vlm_requests(policy, prompts)
        else:
            prompt_ids = policy.encode_prompts(prompts)
            requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        params = self.sampling_params(policy, sampling, group_size, seeds)
        A = sampling.max_new_tokens
        # a LoRA policy's requests name the adapter version just synced
        adapter = {} if self._lora is None else {"lora_request": self._lora.request}
        if sampling.complete_groups or sampling.on_finished is not None:
            outs = stepped_generate(
                llm,
                requests,
                params,
                complete_groups=sampling.complete_groups,
                must_finish=sampling.must_finish,
                on_group=self._reporter(policy, sampling, group_size),
                **adapter,
            )
        else:
            outs = llm.generate(requests, params, use_tqdm=False, **adapter)
        samples = []
        for i, out in enumerate(outs):
            if out is None:  # aborted (over-dispatch): cut short, carried to the next step
                samples += [([], [], False)] * group_size
                continue
            if vlm:
                check_prompt_ids(getattr(out, "prompt_token_ids", None), prompt_ids[i], i)
            for c in out.outputs:
                lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
                samples.append((list(c.token_ids), lps, c.finish_reason == "stop"))
        r = engine_samples_to_rollout(policy, prompts, prompt_ids, samples, group_size, A)
        r.context["temperature"] = float(sampling.temperature) if sampling.temperature > 0 else 1.0
        if vlm:
            attach_media(r, media, group_size)
        policy.stats["samples_generated"] += sum(o is not None for o in outs) * group_size
        policy.stats["tokens_generated"] += int(r.mask.sum())
        self._correct(r)
        if self._can_sleep():
            t0 = time.perf_counter()
            llm.sleep(level=self.sleep_level)
            self._asleep = True
            self.timings["rollout/sleep_s"] = time.perf_counter() - t0
        self._engine.keep_filler(r)  # a lockstep engine's idle passes run on two of these
        return r

    @staticmethod
    def _reporter(policy, sampling, group_size: int):
        """``on_group`` for the step loop: a finished request's samples, as the text the
        rollout will hold, to ``sampling.on_finished`` (rows of this call)."""
        if sampling.on_finished is None:
            return None
        A = sampling.max_new_tokens

        def report(i: int, out) -> None:
            texts = completion_texts(policy, [c.token_ids for c in out.outputs], A)
            sampling.on_finished(list(range(i * group_size, (i + 1) * group_size)), texts)

        return report

    def _correct(self, r: Rollout) -> None:
        """Trainer log-probs become the rollout's; TIS weights and sums into the context."""
        if not len(r):
            return
        engine_lp = r.logprobs
        with torch.no_grad(), self._engine.rollout_weights(self._inner):
            trainer_lp = self._inner.logprobs(r).detach().float()
        w, sums = truncated_is_weights(trainer_lp, engine_lp, r.mask, self.is_cap)
        r.logprobs = trainer_lp
        r.context["engine_logprobs"] = engine_lp
        r.context["is_weight"] = w
        r.context.update(sums)

    def sampling_params(self, policy, sampling, group_size: int, seeds: list[int]) -> list:
        """One vLLM SamplingParams per prompt (its seed), with the adapter's token bans,
        EOS ids and stop strings (kept in the output, as the adapter keeps them)."""
        cls = getattr(self.llm(), "sampling_params_class", None)
        if cls is None:
            import vllm

            cls = vllm.SamplingParams
        banned = set(policy.banned_tokens.tolist())
        allowed = [i for i in range(len(policy.tokenizer)) if i not in banned]
        return [
            cls(
                n=group_size,
                temperature=0.0 if sampling.greedy else float(sampling.temperature),
                top_p=float(sampling.top_p),
                max_tokens=int(sampling.max_new_tokens),
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,
                stop_token_ids=sorted(policy.eos_ids),
                seed=int(seed) % (2**31),
                logprobs=0,
                allowed_token_ids=allowed,
                skip_special_tokens=True,
            )
            for seed in seeds
        ]

    def rollout_stats(self, r: Rollout) -> dict[str, float]:
        out = is_metrics(r, self.dist)
        out.update(self.timings)
        self.timings = {}
        return out


def _reset_caches(llm) -> None:
    """After a weight sync: drop what the engine computed with the old weights -- the
    prefix cache (KV blocks of prompts seen before) and the encoder cache (vision
    embeddings keyed by the media's hash). Without this, a prompt or image seen before
    the update is served from the old model's KV / embeddings."""
    for name in ("reset_prefix_cache", "reset_encoder_cache"):
        fn = getattr(llm, name, None) or getattr(getattr(llm, "llm_engine", None), name, None)
        if fn is not None:
            fn()


def _load_full(llm, weights: dict) -> int:
    """Whole weights (name -> tensor) into the engine, in place; returns their bytes."""
    if hasattr(llm, "load_weights"):  # an engine object that loads weights itself
        llm.load_weights(weights)
    else:
        items = [(k, v.detach()) for k, v in weights.items()]
        llm.collective_rpc(_load_into_worker, args=(items,))
    return tensor_bytes(weights)


def _load_into_worker(worker, items):
    """Runs inside each vLLM worker: load (name, tensor) pairs into its model in place.

    On the CPU backend, vLLM packs every linear weight for oneDNN / its own GEMM after
    loading and frees the plain weight (``dispatch_cpu_unquantized_gemm``): loading into
    the freed parameter leaves the packed copy stale (wrong outputs after a reload).
    There the plain weights are re-created first and every packed layer is re-packed
    after the load. GPU backends load in place as is."""
    import torch
    from vllm.platforms import current_platform

    model = worker.model_runner.model
    packed = []
    if current_platform.is_cpu():
        from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase
        from vllm.model_executor.parameter import ModelWeightParameter

        for m in model.modules():
            if not hasattr(m, "cpu_linear"):
                continue
            packed.append(m)
            if isinstance(m, LinearBase) and m.weight.numel() == 0:
                v2 = type(m.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED
                weight = ModelWeightParameter(
                    data=torch.empty(
                        sum(m.output_partition_sizes),
                        m.input_size_per_partition,
                        dtype=m.params_dtype,
                    ),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=m.weight_loader_v2 if v2 else m.weight_loader,
                )
                m.register_parameter("weight", weight)
    model.load_weights(weights=iter(items))
    for m in packed:  # pack the new weights (frees the plain ones again)
        m.quant_method.process_weights_after_loading(m)
    return True
