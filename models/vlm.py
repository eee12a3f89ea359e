"""VLM policy adapter: Qwen2-VL and Qwen2.5-VL (transformers) from a local directory.

The sampling loop mirrors :mod:`mmyatt.models.text`: our own prefill + KV-cached decode,
per-prompt random generators (a prompt's group is the same on any rank and in any
batch), prompts left-padded to a fixed width P, log-probs of the tempered distribution
recorded at sampling and recomputed with the same numerics. Each prompt (and its media)
is prefilled once and its KV cache repeated for the G samples, so the vision tower runs
B times per rollout, not B * G.

What a VLM adds (media and placeholders: :mod:`mmyatt.models.vlm_inputs`; the model's
positions and forward: :mod:`mmyatt.models.vlm_forward`):

* **M-RoPE positions.** Prompt positions ``(3, N, P)`` come from the model's own
  ``get_rope_index`` (left padding excluded by the attention mask). Everything after
  the prompt is text, whose three position components are equal and continue the
  prompt's last text run, so action ``k`` sits at ``last_prompt_position + 1 + k`` in
  all three components. Decode steps pass exactly that; ``logprobs`` calls
  ``get_rope_index`` on prompt + actions, which yields the same numbers.
* **Banned tokens.** Vision special tokens (``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_pad|>``), the pad token and vocabulary
  rows past the tokenizer are never sampled: their logits are set to the most negative
  float at sampling and scoring alike (a sampled image-pad token would break the
  scoring pass, which expects one image feature per image token).

Rollout.context: ``input_ids`` / ``attention_mask`` (N, P + A) long, ``temperature``
(float) and ``media``: a list of N per-sample dicts (``pixel_values``,
``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
``second_per_grid_ts``; each a tensor or None). Pixel tensors differ in size between
samples, so they are kept as per-sample references rather than padded: the G samples of
a prompt share one dict (no copies), ``Rollout.select`` / ``concat`` index and join the
list, and ``logprobs`` concatenates the tensors of the rows it scores.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmyatt.models import decode  # one decode loop for text and VLM
from mmyatt.models.fast_decode import FastDecode
from mmyatt.models.logprobs import token_logprobs
from mmyatt.models.text import _eos_ids, check_model_dir
from mmyatt.protocols import Sampling, seeded_generator
from mmyatt.rollout import Rollout, prompt_id

from .lora import adapter_tensors, add_lora, base_weights, peft_config
from .vlm_forward import VLMForward
from .vlm_inputs import VLMPrompts

logger = logging.getLogger("mmyatt.models.vlm")

IGNORE_INDEX = -100
VISION_SPECIAL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


class VLMPolicy:
    """The Policy protocol for a Qwen2-VL / Qwen2.5-VL model, tokenizer and image processor.

    ``max_prompt_tokens`` fixes the prompt width P (image/video tokens included) of the
    rollout (generation leaves out the columns that are padding in every prompt of the
    call and puts them back); a longer prompt raises ``PromptTooLongError``
    (truncating would cut vision tokens).
    String prompts become one user message with the record's images and video before
    the text; message-list prompts (OpenAI style, parts ``text`` / ``image`` /
    ``image_url`` / ``video``) are used as given, parts without a payload taking the
    record's images/video in order. ``video_fps`` / ``video_max_frames`` sample videos
    given as paths.
    """

    # generate calls sampling.on_finished as samples finish (placement partial streams them)
    streams_finished = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        image_processor,
        *,
        max_prompt_tokens: int = 128,
        system_prompt: str | None = None,
        video_fps: float = 2.0,
        video_max_frames: int = 8,
        lora: dict | None = None,
    ):
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; a VLM prompt needs one")
        self.model = model
        # LoRA on the language model (models/lora.py): None, or the adapter's options
        self.lora = None if lora is None else add_lora(model, lora)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.reference: nn.Module | None = None
        self.stats: dict[str, int] = {"samples_generated": 0, "tokens_generated": 0}
        # rollout.hf_static_cache / compile_decode (set_decode): fixed-shape decode steps
        # over a cache kept between rollouts (models/fast_decode.py); None: model.forward
        self.fast_decode: FastDecode | None = None

        config = model.config
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        # records -> chat messages, expanded token ids and pixels (vlm_inputs)
        self.prompts = VLMPrompts(
            tokenizer,
            image_processor,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_config=config.vision_config,
            max_prompt_tokens=self.max_prompt_tokens,
            system_prompt=system_prompt,
            video_fps=video_fps,
            video_max_frames=video_max_frames,
        )

        self.eos_ids = _eos_ids(model, tokenizer)
        # What SFT appends after an answer: the end-of-turn token of the chat format
        # when the policy stops on it (Qwen's <|im_end|>), else the tokenizer's EOS.
        im_end = tokenizer.get_vocab().get("<|im_end|>")
        if im_end is not None and int(im_end) in self.eos_ids:
            self.end_id = int(im_end)
        elif tokenizer.eos_token_id is not None:
            self.end_id = int(tokenizer.eos_token_id)
        else:
            self.end_id = min(self.eos_ids)
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token")
        self.pad_id = int(pad)
        vocab = model.get_output_embeddings().weight.shape[0]
        banned = set(range(len(tokenizer), vocab))
        if self.pad_id not in self.eos_ids:
            banned.add(self.pad_id)
        for name in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        ):
            if getattr(config, name, None) is not None:
                banned.add(int(getattr(config, name)))
        vocab_map = tokenizer.get_vocab()
        banned.update(vocab_map[t] for t in VISION_SPECIAL_TOKENS if t in vocab_map)
        banned -= self.eos_ids
        self.banned_ids = sorted(banned)
        self.banned_tokens = torch.tensor(self.banned_ids, dtype=torch.long)

        # positions and forwards, pixels or vision features (vlm_forward)
        self.forward = VLMForward(model, self.image_token_id, self.video_token_id)

    # --- construction ---------------------------------------------------------------
    @classmethod
    def load(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu", **kw
    ) -> VLMPolicy:
        """Model, tokenizer and image processor from a local directory (no hub access).

        Raises FileNotFoundError naming ``path`` and what is missing.
        """
        p = check_model_dir(path, {"preprocessor_config.json": "image processor"})
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = _processor_chat_template(p)
        image_processor = AutoImageProcessor.from_pretrained(
            str(p), local_files_only=True, **_backend_kw()
        )
        model = AutoModelForImageTextToText.from_pretrained(
            str(p), dtype=dtype, local_files_only=True
        )
        return cls(model.to(device), tokenizer, image_processor, **kw)

    def adapter_weights(self) -> tuple[dict[str, Tensor], dict]:
        """The LoRA adapter as peft writes it: its tensors and ``adapter_config.json``."""
        return adapter_tensors(self.model), peft_config(self.lora)

    def base_model_weights(self) -> dict[str, Tensor]:
        """The base model's weights under their own names, the adapter left out."""
        return base_weights(self.model, merged=False)

    def module(self) -> nn.Module:
        return self.model

    def flops_modules(self) -> tuple[nn.Module, nn.Module]:
        """The language model's FLOPs count, not the vision tower's (``DecoderFlops``)."""
        return self.model, self.model.model.language_model

    def save(self, path: str) -> None:
        """Model (safetensors), tokenizer and image processor in Hugging Face layout;
        with LoRA the adapter folded into the weights (a plain checkpoint)."""
        merged = None if self.lora is None else base_weights(self.model, merged=True)
        self.model.save_pretrained(str(path), state_dict=merged)
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))

    def enable_reference(self) -> None:
        """Snapshot the current weights as the frozen KL reference."""
        ref = copy.deepcopy(self.model)
        ref.eval()
        for param in ref.parameters():
            param.requires_grad_(False)
        self.reference = ref

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        if self.reference is None:
            raise RuntimeError("call enable_reference() before reference_logprobs()")
        return self._logprobs(self.reference, rollout, with_entropy=False)

    def set_decode(self, static_cache: bool, compile_step: bool = False) -> None:
        """Decode steps of one fixed shape over a kept key/value cache
        (``models.fast_decode``, the language model's blocks), compiled with
        ``compile_step``; False: every step through the model's ``forward``."""
        if compile_step and not static_cache:
            raise ValueError("compile_decode needs hf_static_cache (a fixed-shape step)")
        if static_cache:
            FastDecode.check(self.model)
        self.fast_decode = FastDecode(compile_step) if static_cache else None

    # --- sampling -------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        """``group_size`` completions per prompt; see the module docstring for context."""
        if len(seeds) != len(prompts):
            raise ValueError(
                f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds"
            )
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        prepared = [self.prepare(rec, i) for i, rec in enumerate(prompts)]
        res = self._sample(prepared, group_size, sampling, seeds, width=self.max_prompt_tokens)
        G = group_size
        media = [prep["media"] for prep in prepared for _ in range(G)]
        return Rollout(
            prompt_ids=[prompt_id(r, i) for i, r in enumerate(prompts) for _ in range(G)],
            actions=res["actions"],
            logprobs=res["logprobs"],
            mask=res["mask"],
            context={
                "input_ids": torch.cat([res["prompt_ids"], res["actions"]], 1),
                "attention_mask": torch.cat([res["prompt_mask"], res["mask"].long()], 1),
                "temperature": res["temperature"],
                "media": media,
            },
            outputs=res["outputs"],
            records=[r for r in prompts for _ in range(G)],
            truncated=~res["stopped"],
        )

    def _sample(
        self, prepared: list[dict], G: int, sampling: Sampling, seeds: list[int], width: int | None
    ) -> dict[str, Any]:
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.temperature <= 0 and not sampling.greedy:
            raise ValueError(f"temperature must be > 0 unless greedy, got {sampling.temperature}")
        temperature = float(sampling.temperature) if sampling.temperature > 0 else 1.0
        device = self._device()
        A = sampling.max_new_tokens
        full_ids, full_attn = self._left_pad([p["ids"] for p in prepared], width, device)
        # columns that are padding in every prompt stay out of the forward passes (as in
        # the text adapter) and come back in the rollout; the fixed-shape steps keep them
        lead = 0 if self.fast_decode is not None else decode.first_used_column(full_attn)
        ids_b, attn_b = full_ids[:, lead:], full_attn[:, lead:]
        media_b = [p["media"] for p in prepared]
        positions_b = self.forward.positions(ids_b, attn_b, media_b)  # (3, B, P - lead)

        # Prefill each prompt once, then repeat its cache for the G samples.
        cache = decode.new_cache(self.model)
        out = self.forward(
            self.model, ids_b, attn_b, positions_b, media=media_b, cache=cache, keep=1
        )
        last_logits = out.logits[:, -1].repeat_interleave(G, 0)
        if G > 1:
            cache.batch_repeat_interleave(G)
        prompt_mask = attn_b.repeat_interleave(G, 0)
        next_pos = positions_b[0, :, -1].repeat_interleave(G, 0) + 1  # (N,) first action
        attn = decode.attention_buffer(prompt_mask, A)  # (N, P + A)
        P = prompt_mask.shape[1]

        def forward_next(token: Tensor, t: int) -> Tensor:
            pos = (next_pos + t).view(1, -1, 1).expand(3, -1, 1)
            cols = attn[:, : P + t + 1]
            out = self.forward(self.model, token[:, None], cols, pos, cache=cache, keep=1)
            return out.logits[:, -1]

        if self.fast_decode is not None:  # text positions: the same on M-RoPE's 3 axes
            fast = self.fast_decode.stepper(self.model, cache, prompt_mask, A)

            def forward_next(token: Tensor, t: int) -> Tensor:  # noqa: F811 (fixed shape)
                return fast(token, (next_pos + t)[:, None], t)

        res, outputs = decode.sample(
            self,
            last_logits,
            forward_next,
            group=G,
            max_new_tokens=A,
            temperature=temperature,
            sampling=sampling,
            generators=[seeded_generator(s, device) for s in seeds],
            complete_groups=sampling.complete_groups,  # over-dispatch: stop when complete
            must_finish=sampling.must_finish,
        )
        actions, logprobs, mask, stopped = res.actions, res.logprobs, res.mask, res.stopped
        return dict(
            actions=actions,
            logprobs=logprobs,
            mask=mask,
            stopped=stopped,
            outputs=outputs,
            prompt_ids=full_ids.repeat_interleave(G, 0),
            prompt_mask=full_attn.repeat_interleave(G, 0),
            temperature=temperature,
        )

    # --- scoring --------------------------------------------------------------------
    def logprobs(
        self, rollout: Rollout, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(N, A) differentiable log pi(a|s), 0.0 where masked; optionally entropies.

        One forward over prompt + completion (with the samples' pixels) at the sampling
        temperature; leading all-pad columns and trailing all-masked action columns are
        skipped, as in the text adapter.
        """
        return self._logprobs(self.model, rollout, with_entropy)

    def _logprobs(self, model: nn.Module, rollout: Rollout, with_entropy: bool):
        device = self._device()
        ids = rollout.context["input_ids"].to(device)
        attn = rollout.context["attention_mask"].to(device)
        temperature = float(rollout.context["temperature"])
        media = rollout.context["media"]
        actions = rollout.actions.to(device)
        mask = rollout.mask.to(device).bool()
        N, A = actions.shape
        P = ids.shape[1] - A
        first = decode.first_used_column(attn[:, :P])
        live = mask.any(0).nonzero()
        last = int(live[-1]) + 1 if len(live) else 1
        ids, attn = ids[:, first : P + last - 1], attn[:, first : P + last - 1]
        positions = self.forward.positions(ids, attn, media)
        out = self.forward(model, ids, attn, positions, media=media, keep=last)
        kept = mask[:, :last]
        # in chunks of rows, never the (N, last, V) logits in fp32 (models/logprobs.py)
        scored = token_logprobs(
            out.logits[:, -last:],
            actions[:, :last],
            temperature,
            self.banned_tokens,
            with_entropy=with_entropy,
        )
        lp, entropy = scored if with_entropy else (scored, None)
        lp = F.pad(torch.where(kept, lp, 0.0), (0, A - last))
        if not with_entropy:
            return lp
        return lp, F.pad(torch.where(kept, entropy, 0.0), (0, A - last))

    def sft_loss(self, records: list[dict], target_key: str = "answer") -> Tensor:
        """Mean cross entropy over completion tokens (``record[target_key]`` + the end of
        turn token), prompt and media tokens excluded, at temperature 1 with the same
        banned tokens as sampling."""
        prepared = [self.prepare(rec, i) for i, rec in enumerate(records)]
        rows, labels = [], []
        for i, (rec, prep) in enumerate(zip(records, prepared)):
            if target_key not in rec:
                raise KeyError(f"record {rec.get('_source', i)!r} has no target key {target_key!r}")
            target = self.tokenizer(str(rec[target_key]), add_special_tokens=False)["input_ids"]
            target = [*target, self.end_id]
            rows.append(prep["ids"] + target)
            labels.append([IGNORE_INDEX] * len(prep["ids"]) + target)
        device = self._device()
        ids, attn = self._left_pad(rows, None, device)
        lab = torch.full_like(ids, IGNORE_INDEX)
        for i, lb in enumerate(labels):
            lab[i, ids.shape[1] - len(lb) :] = torch.tensor(lb)
        media = [p["media"] for p in prepared]
        positions = self.forward.positions(ids, attn, media)
        out = self.forward(self.model, ids, attn, positions, media=media)
        logits = self.tempered(out.logits[:, :-1], 1.0)
        return F.cross_entropy(
            logits.flatten(0, 1), lab[:, 1:].flatten(), ignore_index=IGNORE_INDEX
        )

    # --- judge helpers (GenRM server) ------------------------------------------------
    @torch.no_grad()
    def next_token_logprobs(
        self, messages_batch: list[list[dict]], top_k: int
    ) -> list[list[tuple[str, float]]]:
        """Top-``top_k`` (token text, log-prob) of the first assistant token for each
        OpenAI-style conversation (content a string or parts ``text`` / ``image_url``
        with a data URL or local path / ``image`` with a PIL image). Log-probs are of the
        temperature-1 distribution with banned tokens excluded, most likely first.
        Prompts are padded to the batch's longest and not limited by ``max_prompt_tokens``."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        prepared = [
            self.prepare({"prompt": m}, i, limit=False) for i, m in enumerate(messages_batch)
        ]
        device = self._device()
        ids, attn = self._left_pad([p["ids"] for p in prepared], None, device)
        media = [p["media"] for p in prepared]
        out = self.forward(
            self.model, ids, attn, self.forward.positions(ids, attn, media), media=media, keep=1
        )
        logp = self.tempered(out.logits[:, -1], 1.0).log_softmax(-1)
        k = min(top_k, logp.shape[-1] - len(self.banned_ids))
        values, indices = logp.topk(k, dim=-1)
        return [
            [(self.tokenizer.decode([int(i)]), float(v)) for v, i in zip(vs.tolist(), ix.tolist())]
            for vs, ix in zip(values, indices)
        ]

    @torch.no_grad()
    def generate_text(
        self,
        messages_batch: list[list[dict]],
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        seeds: list[int] | None = None,
        top_p: float = 1.0,
        stop: tuple[str, ...] = (),
    ) -> list[tuple[str, list[float]]]:
        """One completion per conversation: (text, per-token log-probs). ``temperature``
        0 is greedy (log-probs then at temperature 1). Prompts are padded to the batch's
        longest and not limited by ``max_prompt_tokens``."""
        seeds = list(seeds) if seeds is not None else list(range(len(messages_batch)))
        if len(seeds) != len(messages_batch):
            raise ValueError(
                f"need one seed per conversation: {len(messages_batch)} vs {len(seeds)}"
            )
        sampling = Sampling(
            temperature=temperature if temperature > 0 else 1.0,
            greedy=temperature <= 0,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop),
        )
        prepared = [
            self.prepare({"prompt": m}, i, limit=False) for i, m in enumerate(messages_batch)
        ]
        res = self._sample(prepared, 1, sampling, seeds, width=None)
        lengths = res["mask"].sum(-1).long().tolist()
        return [
            (text, res["logprobs"][i, :n].tolist())
            for i, (text, n) in enumerate(zip(res["outputs"], lengths))
        ]

    # --- device ----------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- prompts and media (MediaPrompts; vlm_inputs, vlm_features) -----------------------
    def prepare(self, record: dict, index: int, *, limit: bool = True) -> dict:
        """{"ids": prompt token ids (placeholders expanded), "media": per-sample tensors};
        ``limit`` enforces ``max_prompt_tokens``."""
        return self.prompts.prepare(record, index, limit=limit)

    def messages(self, record: dict, source: str) -> tuple[list[dict], list, list]:
        return self.prompts.messages(record, source)

    def image_token_count(self, image) -> int:
        """How many ``<|image_pad|>`` tokens an image becomes."""
        return self.prompts.image_token_count(image)

    def encode_media(self, rollout: Rollout) -> Rollout:
        """``rollout`` with each sample's pixels replaced by the frozen vision tower's
        output (``VisionFeatures.encode_media``)."""
        return self.forward.features.encode_media(rollout)

    def encode_prompts(self, records: list[dict]) -> list[list[int]]:
        """Each record's prompt ids, vision placeholders expanded (its media are read)."""
        return [self.prepare(record, i)["ids"] for i, record in enumerate(records)]

    def tempered(self, logits: Tensor, temperature: float) -> Tensor:
        return decode.temper(logits, temperature, self.banned_tokens)

    def _left_pad(self, seqs: list[list[int]], width: int | None, device) -> tuple[Tensor, Tensor]:
        P = width if width is not None else max(len(s) for s in seqs)
        ids = torch.full((len(seqs), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), P, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, P - len(s) :] = 1
        return ids.to(device), attn.to(device)


# --- helpers -------------------------------------------------------------------------
def _backend_kw() -> dict:
    """Ask for the PIL image processor when torchvision is unusable (no warning)."""
    try:
        from transformers.utils import is_torchvision_available
    except ImportError:
        return {}
    return {} if is_torchvision_available() else {"backend": "pil"}


def _processor_chat_template(path: Path) -> str | None:
    """The chat template of a processor-style checkpoint (chat_template.json / .jinja)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = path / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return None
