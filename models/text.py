"""Text policy adapter: any Hugging Face causal LM from a local directory.

Sampling is our own loop (prefill + KV-cached decode) rather than ``model.generate``,
because RL needs exactly the numbers ``logprobs`` will recompute: the same position
ids, attention mask, temperature and token bans at sampling time and at training time,
so the first PPO/GRPO ratio is 1 up to float error, and per-prompt random generators,
so a prompt's group is the same whichever rank or batch samples it.

Shapes: B prompts, G samples per prompt, N = B * G rows (groups contiguous),
P = ``max_prompt_tokens`` (every prompt is left-padded to exactly P), A = the action
budget ``max_new_tokens``, V = the model's vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmyatt.protocols import Sampling, seeded_generator
from mmyatt.rollout import Rollout, prompt_id

from . import cpu_kernels, decode
from .fast_decode import FastDecode
from .logprobs import token_logprobs
from .lora import adapter_tensors, add_lora, base_weights, peft_config

IGNORE_INDEX = -100  # label value cross_entropy skips (prompt and padding in SFT)


def check_model_dir(path: str | Path, needs: dict[str, str] | None = None) -> Path:
    """``path`` as a Path; FileNotFoundError naming it and what is missing unless it is a
    folder with a config, weights, tokenizer files and each file of ``needs`` (file name
    -> what it is, e.g. the VLM's image processor)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no model directory at {str(p)!r}")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        missing.append("tokenizer (tokenizer.json or tokenizer_config.json)")
    missing += [
        f"{what} ({name})" for name, what in (needs or {}).items() if not (p / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"model directory {str(p)!r} is incomplete: missing {', '.join(missing)}"
        )
    return p


class PromptTooLongError(ValueError):
    """A prompt has more tokens than ``max_prompt_tokens`` and overflow is "reject"."""


class TextPolicy:
    """The Policy protocol for a causal LM and its tokenizer.

    ``max_prompt_tokens`` fixes the prompt width P: prompts are left-padded to exactly
    P so rollouts from different sampling rounds concatenate (generation runs its
    forward passes without the columns that are padding in every prompt of the call, and
    puts them back in the rollout). A longer prompt raises
    ``PromptTooLongError`` ("reject") or keeps its last P tokens ("truncate", counted in
    ``stats["prompts_truncated"]``). Prompts that are message lists always go through
    the tokenizer's chat template; string prompts do when ``use_chat_template``, as a
    single user message after ``system_prompt`` if one is given.

    Recorded log-probs are ``log_softmax(logits / temperature)`` of the chosen token over
    the full tempered distribution, *not* renormalised after top-p filtering (the
    choice verl and most RL trainers make): top-p is a sampling heuristic, the policy
    being optimised is the tempered model, and ``logprobs`` can recompute it exactly
    without knowing which tokens the nucleus held.

    The pad token (when it is not also an EOS) and any vocabulary rows past the
    tokenizer's size are banned in that distribution, at sampling and at scoring
    alike. Pad is never a training target, so its logit is untrained noise; a sampled
    pad would be dropped when decoding (the reward scores text the actions do not
    contain) and anything that rebuilds masks from ``ids != pad`` would treat it as
    padding. Rows past the tokenizer (vocabularies padded to a multiple of 64) decode
    to nothing at all.
    """

    # generate calls sampling.on_finished as samples finish (placement partial streams them)
    streams_finished = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        max_prompt_tokens: int = 64,
        prompt_overflow: str = "reject",
        use_chat_template: bool = False,
        system_prompt: str | None = None,
        lora: dict | None = None,
    ):
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if prompt_overflow not in ("reject", "truncate"):
            raise ValueError(
                f"prompt_overflow must be 'reject' or 'truncate', got {prompt_overflow!r}"
            )
        if system_prompt is not None and not use_chat_template:
            # Without the template there is nowhere to put it; failing beats dropping it.
            raise ValueError("system_prompt needs use_chat_template=True")
        self.model = model
        # LoRA (models/lora.py): None, or the adapter's options; only the adapter trains
        self.lora = None if lora is None else add_lora(model, lora)
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.prompt_overflow = prompt_overflow
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.stats: dict[str, int] = {
            "prompts_truncated": 0,
            "samples_generated": 0,
            "tokens_generated": 0,
        }

        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        if pad is None:  # Llama-style tokenizers: pad with EOS (masked out anyway)
            pad = tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token")
        self.pad_id = int(pad)
        vocab = model.get_output_embeddings().weight.shape[0]
        banned = list(range(len(tokenizer), vocab))
        if self.pad_id not in self.eos_ids:  # banning an EOS would stop the policy stopping
            banned.append(self.pad_id)
        self.banned_tokens = torch.tensor(sorted(banned), dtype=torch.long)
        params = inspect.signature(model.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        # transformers 5.2x renamed past_key_values to cache (the old name is deprecated).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # decode steps over a pre-allocated cache where the architecture allows it
        # (models/decode.py StaticKVDecoder); False: every step through model.forward
        self.static_decode = True
        # prefill and scoring forwards over short rows on the CPU use grouped-query
        # attention without key/value copies (models/cpu_kernels.py; decode steps have their
        # own, StaticKVDecoder); False: the model's own attention kernel
        self.cpu_kernels = True
        # scoring runs a group's shared prompt once and gathers its cache to the rows
        self._can_share_prefix = hasattr(decode.new_cache(self.model), "layers")
        # rollout.hf_static_cache / compile_decode (set_decode): fixed-shape decode steps
        # over a cache kept between rollouts, compiled or not; None: the steps above
        self.fast_decode: FastDecode | None = None

    def set_decode(self, static_cache: bool, compile_step: bool = False) -> None:
        """Decode steps of one fixed shape over a kept key/value cache
        (``models.fast_decode``), compiled with ``compile_step``; False: as built."""
        if compile_step and not static_cache:
            raise ValueError("compile_decode needs hf_static_cache (a fixed-shape step)")
        if static_cache:
            FastDecode.check(self.model)
        self.fast_decode = FastDecode(compile_step) if static_cache else None

    # --- construction ---------------------------------------------------------------
    @classmethod
    def load(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu", **kw
    ) -> TextPolicy:
        """Load model and tokenizer from a local directory (no hub access).

        Raises FileNotFoundError naming ``path`` and what is missing when the directory
        does not exist or lacks a config, weights or tokenizer files.
        """
        p = check_model_dir(path)
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True)
        return cls(model.to(device), tokenizer, **kw)

    def enable_reference(self) -> None:
        """Snapshot the current weights as the frozen KL reference (a second copy)."""
        import copy

        self._reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """(N, A) log pi_ref(a|s) under the snapshot taken by ``enable_reference``."""
        reference = getattr(self, "_reference", None)
        if reference is None:
            raise RuntimeError("reference_logprobs needs enable_reference() first")
        model, self.model = self.model, reference
        try:
            with torch.no_grad():
                return self.logprobs(rollout)
        finally:
            self.model = model

    def adapter_weights(self) -> tuple[dict[str, Tensor], dict]:
        """The LoRA adapter as peft writes it: its tensors and ``adapter_config.json``."""
        return adapter_tensors(self.model), peft_config(self.lora)

    def base_model_weights(self) -> dict[str, Tensor]:
        """The base model's weights under their own names, the adapter left out."""
        return base_weights(self.model, merged=False)

    def module(self) -> nn.Module:
        return self.model

    def flops_modules(self) -> tuple[nn.Module, nn.Module]:
        """Every token goes through the whole causal LM (``DecoderFlops``)."""
        return self.model, self.model

    def save(self, path: str) -> None:
        """Model (safetensors) and tokenizer in Hugging Face layout; with LoRA the
        adapter folded into the weights (a plain checkpoint)."""
        merged = None if self.lora is None else base_weights(self.model, merged=True)
        self.model.save_pretrained(str(path), state_dict=merged)
        self.tokenizer.save_pretrained(str(path))

    # --- sampling -------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: recorded tensors later meet autograd in losses
    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt; see the class docstring.

        Returns a Rollout with actions (N, A) long (pad after the stop), logprobs and
        mask (N, A) float32, truncated (N,) bool, and context ``input_ids`` /
        ``attention_mask`` (N, P + A) plus the sampling ``temperature``.
        """
        if len(seeds) != len(prompts):
            raise ValueError(
                f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds"
            )
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.temperature <= 0 and not sampling.greedy:
            raise ValueError(f"temperature must be > 0 unless greedy, got {sampling.temperature}")
        # Greedy ignores temperature for choosing; it still sets what log-probs mean.
        temperature = float(sampling.temperature) if sampling.temperature > 0 else 1.0
        device = self._device()
        G, A = group_size, sampling.max_new_tokens

        # Prefill each prompt once (B rows), then repeat its cache for the G samples.
        # Columns that are padding in every prompt are left out of the forward passes
        # (they weigh exactly 0 in every softmax and do not shift the positions) and put
        # back in the rollout, whose prompts are P wide; the fixed-shape decode steps of
        # hf_static_cache keep them, as their cache shape is P + A.
        full_b, full_mask = self._left_pad(self.encode_prompts(prompts), device)
        lead = 0 if self.fast_decode is not None else decode.first_used_column(full_mask)
        prompt_b, mask_b = full_b[:, lead:], full_mask[:, lead:]
        positions = (mask_b.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift RoPE
        cache = decode.new_cache(self.model)
        out = self._forward(prompt_b, mask_b, positions, cache=cache, keep=1)
        first_logits = out.logits[:, -1].repeat_interleave(G, 0)  # (N, V)
        if G > 1:
            cache.batch_repeat_interleave(G)
        prompt_mask = mask_b.repeat_interleave(G, 0)  # (N, P - lead)
        P = prompt_mask.shape[1]
        attn = decode.attention_buffer(prompt_mask, A)  # (N, P - lead + A)
        next_position = prompt_mask.sum(-1, keepdim=True)  # (N, 1) position of action 0

        def forward_next(token: Tensor, t: int) -> Tensor:
            cols = attn[:, : P + t + 1]
            out = self._forward(token[:, None], cols, next_position + t, cache=cache, keep=1)
            return out.logits[:, -1]

        if self.fast_decode is not None and self._can_share_prefix:
            fast = self.fast_decode.stepper(self.model, cache, prompt_mask, A)

            def forward_next(token: Tensor, t: int) -> Tensor:  # noqa: F811 (fixed shape)
                return fast(token, next_position + t, t)

        elif (
            self.static_decode
            and self._can_share_prefix
            and decode.StaticKVDecoder.supports(self.model)
        ):
            static = decode.StaticKVDecoder(self.model, cache, prompt_mask, A)

            def forward_next(token: Tensor, t: int) -> Tensor:  # noqa: F811 (the fast path)
                return static.step(token, next_position + t, t)

        res, outputs = decode.sample(
            self,
            first_logits,
            forward_next,
            group=G,
            max_new_tokens=A,
            temperature=temperature,
            sampling=sampling,
            generators=[seeded_generator(s, device) for s in seeds],
            complete_groups=sampling.complete_groups,
            must_finish=sampling.must_finish,
        )
        actions, logprobs, mask, stopped = res.actions, res.logprobs, res.mask, res.stopped
        return Rollout(
            prompt_ids=[prompt_id(r, i) for i, r in enumerate(prompts) for _ in range(G)],
            actions=actions,
            logprobs=logprobs,
            mask=mask,
            context={
                "input_ids": torch.cat([full_b.repeat_interleave(G, 0), actions], 1),
                "attention_mask": torch.cat([full_mask.repeat_interleave(G, 0), mask.long()], 1),
                "temperature": temperature,
            },
            outputs=outputs,
            records=[r for r in prompts for _ in range(G)],
            truncated=~stopped,
        )

    # --- scoring --------------------------------------------------------------------
    def logprobs(
        self, rollout: Rollout, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(N, A) differentiable log pi(a|s) under current weights, 0.0 where masked;
        with ``with_entropy`` also the (N, A) entropy of the tempered distribution.

        A forward over prompt + completion (the prompt once per group, see
        ``_action_logits``) with the sampling-time position ids and temperature; the
        log-prob of each action is its logit minus the logsumexp, taken a chunk of rows at
        a time (``models.logprobs.token_logprobs``). Leading columns that are padding in
        every row and trailing action columns masked in every row are skipped: they
        cannot affect any kept value.
        """
        device = self._device()
        ids = rollout.context["input_ids"].to(device)  # (N, P + A)
        attn = rollout.context["attention_mask"].to(device)  # (N, P + A)
        temperature = float(rollout.context["temperature"])
        actions = rollout.actions.to(device)  # (N, A)
        mask = rollout.mask.to(device).bool()  # (N, A)
        A = actions.shape[1]
        P = ids.shape[1] - A

        first = decode.first_used_column(attn[:, :P])
        live = mask.any(0).nonzero()
        last = int(live[-1]) + 1 if len(live) else 1  # action columns to score
        # Position P - 1 + k predicts action k, so the last action is never an input.
        ids, attn = ids[:, first : P + last - 1], attn[:, first : P + last - 1]
        logits = self._action_logits(ids, attn, P - first, last)  # (N, last, V)
        kept = mask[:, :last]
        # in chunks of rows, never the (N, last, V) logits in fp32 (models/logprobs.py)
        scored = token_logprobs(
            logits, actions[:, :last], temperature, self.banned_tokens, with_entropy=with_entropy
        )
        lp, entropy = scored if with_entropy else (scored, None)
        # where, not multiply: a masked action (pad) can score -inf-like and 0 * -inf = NaN.
        lp = F.pad(torch.where(kept, lp, 0.0), (0, A - last))
        if not with_entropy:
            return lp
        return lp, F.pad(torch.where(kept, entropy, 0.0), (0, A - last))

    def _action_logits(self, ids: Tensor, attn: Tensor, P: int, last: int) -> Tensor:
        """(N, last, V) raw logits of positions P - 1 .. P + last - 2 of ``ids`` (N, L):
        the ones that predict actions 0 .. last - 1.

        Rows of one group carry the same prompt, so the prompt is run once per distinct
        prompt (consecutive equal rows) and its keys and values are gathered to every
        row of the group: autograd sums the group's gradients into the one prompt pass.
        The same numbers as one forward over all rows, up to rounding (the attention of
        the actions is split into a cached prefix and the rest, as in sampling).
        """
        first_row, owner = decode.share_prefix_rows(ids[:, :P], attn[:, :P])
        # With one action column the prompt's last column moves to the second pass, so
        # that the pass still makes two forwards, as with more columns: on a sharded
        # engine forwards are collectives, and every rank must make the same ones
        # (docs/engines.md). Not where a prompt row would be left with no token.
        cut = P if last > 1 else (P - 1 if bool(attn[first_row, : P - 1].any(-1).all()) else 0)
        if len(first_row) == ids.shape[0] or not self._can_share_prefix or cut < 1:
            positions = (attn.cumsum(-1) - 1).clamp(min=0)
            return self._forward(ids, attn, positions, keep=last).logits[:, -last:]
        cache = decode.new_cache(self.model)
        p_ids, p_attn = ids[first_row, :cut], attn[first_row, :cut]
        p_pos = (p_attn.cumsum(-1) - 1).clamp(min=0)
        head = self._forward(p_ids, p_attn, p_pos, cache=cache, keep=1).logits[:, -1:]
        for layer in cache.layers:  # (U, ...) -> (N, ...), differentiable
            layer.batch_select_indices(owner)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, cut:]
        tail = self._forward(ids[:, cut:], attn, positions, cache=cache).logits
        if cut < P:  # the tail's one column predicts action 0; the prompt pass's output
            # joins the loss with weight 0, so a sharded backward runs the hooks of
            # every module it ran through (as with more columns)
            return tail + 0.0 * head.sum()
        return torch.cat([head.index_select(0, owner), tail], 1)  # head predicts action 0

    def sft_inputs(self, records: list[dict], target_key: str = "answer") -> dict[str, Tensor]:
        """Teacher-forcing batch: prompt (formatted as in ``generate``) + target + EOS.

        Returns input_ids, attention_mask, labels, each (B, L), left-padded; labels
        are ``IGNORE_INDEX`` on prompt and padding so only completion tokens count.
        """
        prompts = self.encode_prompts(records)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = min(self.eos_ids)
        rows, labels = [], []
        for i, (rec, prompt) in enumerate(zip(records, prompts)):
            if target_key not in rec:
                raise KeyError(f"record {rec.get('_source', i)!r} has no target key {target_key!r}")
            target = self.tokenizer(str(rec[target_key]), add_special_tokens=False)["input_ids"]
            target = [*target, eos]
            rows.append(prompt + target)
            labels.append([IGNORE_INDEX] * len(prompt) + target)
        width = max(len(r) for r in rows)
        device = self._device()
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(rows), width, dtype=torch.long)
        lab = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, (r, lb) in enumerate(zip(rows, labels)):
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
            lab[i, width - len(r) :] = torch.tensor(lb)
        return {
            "input_ids": ids.to(device),
            "attention_mask": attn.to(device),
            "labels": lab.to(device),
        }

    def sft_loss(self, records: list[dict], target_key: str = "answer") -> Tensor:
        """Mean cross entropy over completion tokens (``record[target_key]`` + EOS),
        teacher-forced, prompt tokens excluded; the same distribution as sampling at
        temperature 1 (banned ids included)."""
        batch = self.sft_inputs(records, target_key)
        attn = batch["attention_mask"]
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(batch["input_ids"], attn, positions)
        logits = self.tempered(out.logits[:, :-1], 1.0)  # position t predicts token t + 1
        labels = batch["labels"][:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    # --- internals ------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tempered(self, logits: Tensor, temperature: float) -> Tensor:
        """(..., V) fp32 logits / temperature with banned ids at the most negative float.

        Not -inf: exp still underflows to exactly 0, but p * log p stays 0 in the
        entropy instead of 0 * -inf = NaN.
        """
        return decode.temper(logits, temperature, self.banned_tokens)

    def _forward(self, ids: Tensor, attn: Tensor, positions: Tensor, *, cache=None, keep: int = 0):
        kw = {self._cache_kwarg: cache}
        if keep and self._has_logits_to_keep:  # skip the (N, L, V) logits we would discard
            kw["logits_to_keep"] = keep
        with self._kernels(attn.shape[1]):
            return self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=positions,
                use_cache=cache is not None,
                **kw,
            )

    def _kernels(self, length: int):
        """The CPU attention of models/cpu_kernels.py for a forward over ``length`` keys,
        where they apply (and ``cpu_kernels`` is on); else a no-op block."""
        if self.cpu_kernels and cpu_kernels.applies(self.model, length):
            return cpu_kernels.fast_forward(self.model)
        return contextlib.nullcontext()

    def _prompt_text(self, record: dict) -> tuple[str, bool]:
        """The prompt as text, and whether the tokenizer should add its special tokens
        (a chat template writes its own, e.g. a BOS, so they must not be added twice)."""
        prompt = record["prompt"]
        if isinstance(prompt, str) and not self.use_chat_template:
            return prompt, True
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("prompt needs a chat template but the tokenizer has none")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text, False

    def encode_prompts(self, records: list[dict]) -> list[list[int]]:
        """Token ids per record, each at most ``max_prompt_tokens`` long."""
        encoded = []
        for i, rec in enumerate(records):
            text, add_special = self._prompt_text(rec)
            ids = list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])
            name = rec.get("_source") or f"index {rec.get('_index', i)}"
            if not ids:
                raise ValueError(f"prompt {name} is empty after tokenization")
            if len(ids) > self.max_prompt_tokens:
                if self.prompt_overflow == "reject":
                    raise PromptTooLongError(
                        f"prompt {name} has {len(ids)} tokens, over max_prompt_tokens="
                        f"{self.max_prompt_tokens}; shorten it, raise the limit or set "
                        "prompt_overflow='truncate'"
                    )
                ids = ids[-self.max_prompt_tokens :]  # the end holds the question to answer
                self.stats["prompts_truncated"] += 1
            encoded.append(ids)
        return encoded

    def _left_pad(self, seqs: list[list[int]], device) -> tuple[Tensor, Tensor]:
        """(B, P) ids and attention mask, each sequence right-aligned at width P."""
        P = self.max_prompt_tokens
        ids = torch.full((len(seqs), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), P, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, P - len(s) :] = 1
        return ids.to(device), attn.to(device)


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    """Every id that ends a completion: the generation config's (int or list) and the
    tokenizer's EOS (instruct models often list both <|im_end|> and <|endoftext|>)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, list | tuple) else [value]))
    if not ids:
        raise ValueError("neither the generation config nor the tokenizer names an EOS token")
    return ids
