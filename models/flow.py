"""Flow-matching text-to-image / text-to-video generators as RL policies (Flow-GRPO).

``FlowPolicy`` wraps a diffusers transformer (``SD3Transformer2DModel``,
``FluxTransformer2DModel`` or ``WanTransformer3DModel``) plus a frozen text encoder and
implements the Policy protocol: a rollout's actions are the denoising transitions
x_k -> x_{k+1} at the trained steps, each with the log-prob of the Gaussian SDE step of
``flow_sde``; the denoising loop that samples them is ``flow_sampler``'s.

It runs the tiny built-ins (``flow_tiny``) in PIXEL space and standard diffusers
pipeline folders (SD3, Flux, Wan 2.1; ``flow_pipeline``) in LATENT space; loading,
saving and LoRA adapters are in ``flow_io``; the KL to a reference policy in ``flow_kl``
and the EMA of the trained weights in ``ema`` (objects the policy holds).

Exact PPO ratio. diffusers models on CPU are not batch-size invariant: the small
(B, D) matmuls of the timestep/pooled embedders and the adaLN modulation take a
different kernel when B < 4 (GEMV vs GEMM), and the patch-embedding convolution picks
a batch-dependent oneDNN algorithm, so a sample's velocity changes in the last bits
with the batch it is evaluated in. GPU kernels (split-K GEMMs, cuDNN) do the same. The
policy therefore runs every transformer forward on exactly ``forward_batch`` rows,
padding the last chunk with copies of its first row: each row's result then depends
only on its own inputs, whether it is evaluated while sampling (rows = samples at one
step) or while training (rows = (sample, step) pairs of any micro-batch), and the
first-update ratio is exactly 1 (tested with torch.equal). Permuting rows inside a
fixed-size batch was verified not to change results.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor, nn

from mmyatt.models import flow_io
from mmyatt.models.builtin.flow_tiny import POSITION_PLANES
from mmyatt.models.ema import EMAWeights
from mmyatt.models.flow_io import TRANSFORMERS, add_lora, images_to_tensor, tensor_to_images
from mmyatt.models.flow_kl import FlowReference, transition_kl
from mmyatt.models.flow_pipeline import pipeline_sigmas, transformer_forward
from mmyatt.models.flow_sampler import denoise, initial_noise, step_fn
from mmyatt.models.flow_sde import flow_sigmas, plan_steps, step_entropy
from mmyatt.protocols import Sampling, seeded_generator
from mmyatt.rollout import Rollout

__all__ = ["FlowPolicy"]


class FlowPolicy:
    """A flow-matching generator as a policy over denoising transitions.

    Args:
        transformer: SD3Transformer2DModel / FluxTransformer2DModel (images) or
            WanTransformer3DModel (video), predicting the velocity eps - x0.
        text_encoder: CLIPTextModelWithProjection (frozen here).
        tokenizer: its tokenizer; prompts are padded to ``max_length``.
        scheduler_shift: the FlowMatchEulerDiscreteScheduler shift of the sigma schedule.
        image_size, channels, num_frames: pixel geometry (num_frames for video only).
        patch_size: packing of pixels for Flux (SD3 and Wan patchify inside the model).
        lora: None, or dict(r=, alpha=, target_modules=, init="gaussian", dropout=0.0):
            peft LoRA on the attention projections; then only LoRA weights train.
        reference: "lora_disabled" (KL reference = this transformer with its adapters
            off, no second copy; without LoRA a frozen copy is taken instead) or
            "frozen_copy" (a copy snapshotted by ``enable_reference``).
        cfg_uncond_prompt: the caption of the unconditional CFG branch.
        forward_batch: every transformer call runs on exactly this many rows (padded),
            which makes results batch-composition invariant (see the module docstring).
            None runs whole batches and gives up the exact first-update ratio.
        max_length: token length of prompts (default: the tokenizer's model_max_length).
        position_channels: Wan only. The transformer's input is the sample plus 5 constant
            planes (``position_planes``: frame index, row, column in [-1, 1], frame x row,
            frame x column); its in_channels must be channels + 5. Wan sees positions only
            through RoPE, which is relative; the planes give a tiny Wan absolute
            positions, and the products make "moving right" a pairing of the direction
            word with one plane. Without them the tiny model never followed the
            direction word (BENCHMARKS.md, video demo).
    """

    def __init__(
        self,
        transformer: nn.Module,
        text_encoder: nn.Module,
        tokenizer,
        scheduler_shift: float = 3.0,
        *,
        image_size: int,
        channels: int = 3,
        num_frames: int | None = None,
        patch_size: int = 2,
        lora: dict | None = None,
        reference: str = "lora_disabled",
        cfg_uncond_prompt: str = "",
        forward_batch: int | None = 8,
        max_length: int | None = None,
        prompt_encoder: nn.Module | None = None,
        vae: nn.Module | None = None,
        scheduler_config: dict | None = None,
        embedded_guidance: float = 3.5,
        pipeline: dict | None = None,
        position_channels: bool = False,
    ):
        name = type(transformer).__name__
        if name not in TRANSFORMERS:
            raise ValueError(
                f"unsupported transformer {name}; expected one of {sorted(TRANSFORMERS)}"
            )
        if reference not in ("lora_disabled", "frozen_copy"):
            raise ValueError(
                f"reference must be 'lora_disabled' or 'frozen_copy', got {reference!r}"
            )
        if forward_batch is not None and forward_batch < 1:
            raise ValueError(f"forward_batch must be >= 1 or None, got {forward_batch}")
        self.family = TRANSFORMERS[name]
        if (self.family == "wan") != (num_frames is not None):
            raise ValueError("num_frames is required for WanTransformer3DModel and only for it")
        self.position_channels = bool(position_channels)
        if self.position_channels:
            want = channels + POSITION_PLANES
            got = transformer.config.get("in_channels")
            if self.family != "wan" or got != want:
                raise ValueError(
                    f"position_channels needs a WanTransformer3DModel with in_channels = "
                    f"channels + {POSITION_PLANES} = {want}; got {name} with in_channels {got}"
                )
        self.transformer = transformer
        if prompt_encoder is None and (text_encoder is None or tokenizer is None):
            raise ValueError("FlowPolicy needs text_encoder and tokenizer, or a prompt_encoder")
        self.text_encoder = (
            None if text_encoder is None else text_encoder.eval().requires_grad_(False)
        )
        self.tokenizer = tokenizer
        self.prompt_encoder = (
            None if prompt_encoder is None else prompt_encoder.eval().requires_grad_(False)
        )
        if self.text_encoder is None:  # pipelines: all text encoders as one module
            self.text_encoder = self.prompt_encoder
        self.vae = vae  # latent codec (flow_pipeline.ImageVAE / VideoVAE) or None: pixels
        self.scheduler_config = scheduler_config  # a real pipeline's scheduler (its sigmas)
        self.embedded_guidance = float(embedded_guidance)
        self._pipeline = pipeline  # {"index": model_index, "components": {...}} when loaded
        self.shift = float(scheduler_shift)
        self.image_size, self.channels, self.num_frames = image_size, channels, num_frames
        self.patch_size = patch_size
        self.reference = reference
        self.cfg_uncond_prompt = cfg_uncond_prompt
        self.forward_batch = forward_batch
        self.max_length = (
            int(max_length or tokenizer.model_max_length) if tokenizer is not None else max_length
        )
        self._t_scale = float((scheduler_config or {}).get("num_train_timesteps", 1000))
        self.lora = None
        self.kl_reference = FlowReference()  # enable_reference fixes it
        self.ema = EMAWeights(self._trainable)  # model.ema_decay: averages of the trained weights
        # False: rollouts return the final samples (latents) as outputs and skip the VAE
        # decode, for rewards that read latents (rewards/image.py reads_latents)
        self.decode_outputs = True
        self.shared_group_noise = True  # one initial noise per group (see generate)
        if lora is not None:
            add_lora(self, lora)

    # ---- loading and saving (flow_io) --------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, **kwargs) -> FlowPolicy:
        """Load a pipeline directory written by ``build_tiny_flow_model``, ``save`` or
        diffusers' ``save_pretrained`` (SD3, Flux, Wan 2.1), with its saved LoRA adapter
        if any; kwargs go to the constructor (``flow_io.load``)."""
        return flow_io.load(cls, path, **kwargs)

    def save(self, path: str, merged: bool = False) -> None:
        """Write a diffusers-layout pipeline directory; with LoRA the adapter goes to
        ``pytorch_lora_weights.safetensors`` unless ``merged`` (``flow_io.save``)."""
        flow_io.save(self, path, merged)

    # ---- protocol ---------------------------------------------------------------------
    def module(self) -> nn.Module:
        return self.transformer

    def to(self, device: str | torch.device) -> FlowPolicy:
        """Move every module (transformer, text encoders, VAE, frozen reference) to device."""
        for m in (self.transformer, self.text_encoder, self.vae, self.kl_reference.copy):
            if m is not None:
                m.to(device)
        return self

    def _follow(self, module: nn.Module) -> nn.Module:
        """A frozen helper module on the transformer's device (moved on first use)."""
        p = next(module.parameters(), None)
        if p is not None and p.device != self.device:
            module.to(self.device)
        return module

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample x_k: pixels (tiny built-ins) or VAE latents (pipelines)."""
        s, f = self.image_size, self.num_frames
        if self.vae is not None:
            s = s // self.vae.spatial
            if self.family == "flux":  # Flux packs 2x2 latent patches: even latent sizes
                s = 2 * (self.image_size // (self.vae.spatial * 2))
            if f is not None:
                f = (f - 1) // self.vae.temporal + 1
        if self.family == "wan":
            return (self.channels, f, s, s)
        return (self.channels, s, s)

    def _image_seq_len(self) -> int:
        """Image tokens the transformer sees (for resolution-dependent sigma shifts)."""
        shape = self.sample_shape
        if self.family == "flux":
            return (shape[-2] // self.patch_size) * (shape[-1] // self.patch_size)
        p = self.transformer.config.patch_size
        p = p[-1] if isinstance(p, list | tuple) else p
        return (shape[-2] // p) * (shape[-1] // p)

    def _sigmas(self, steps: int) -> Tensor:
        if self.scheduler_config is None:
            return flow_sigmas(steps, self.shift)
        return pipeline_sigmas(self.scheduler_config, self.family, steps, self._image_seq_len())

    def to_pixels(self, x: Tensor) -> Tensor:
        """Final samples -> pixels in [-1, 1] (VAE decode in chunks of forward_batch rows)."""
        if self.vae is None:
            return x
        chunk = self.forward_batch or max(1, x.shape[0])
        self._follow(self.vae)
        with torch.no_grad():
            return torch.cat([self.vae.decode(x[i : i + chunk]) for i in range(0, len(x), chunk)])

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(B, L, D) token states and (B, Dp) pooled projections, fp32. Gradients flow
        only if the text encoder's weights require them (pretraining)."""
        if self.prompt_encoder is not None:
            return self._follow(self.prompt_encoder)(list(prompts), self.device)
        tok = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        return out.last_hidden_state.float(), out.text_embeds.float()

    def _encode_each(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        # One prompt per call: a prompt's embedding must not depend on its batch mates
        # (rank invariance); the text encoder is tiny next to the denoising loop.
        with torch.no_grad():
            parts = [self.encode_prompts([p]) for p in prompts]
        return torch.cat([c for c, _ in parts]), torch.cat([p for _, p in parts])

    def _forward(
        self, model: nn.Module, x: Tensor, sigma: Tensor, cond: Tensor, pooled: Tensor
    ) -> Tensor:
        """Raw velocity for rows x (R, ...), sigma (R,), cond (R, L, D), pooled (R, Dp)."""
        return transformer_forward(
            self.family,
            model,
            x,
            sigma,
            cond,
            pooled,
            t_scale=self._t_scale,
            patch_size=self.patch_size,
            embedded_guidance=self.embedded_guidance,
            position_channels=self.position_channels,
        )

    def velocity(
        self, model: nn.Module, x: Tensor, sigma: Tensor, cond: Tensor, pooled: Tensor
    ) -> Tensor:
        """Velocity (R, ...) fp32, evaluated in padded chunks of exactly forward_batch rows."""
        n = x.shape[0]
        fb = self.forward_batch
        if fb is None or n == 0:
            return self._forward(model, x, sigma, cond, pooled).float()
        outs = []
        for i in range(0, n, fb):
            parts = [t[i : i + fb] for t in (x, sigma, cond, pooled)]
            pad = fb - parts[0].shape[0]
            if pad:  # copies of the chunk's first row; their outputs are dropped
                parts = [torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in parts]
            outs.append(self._forward(model, *parts)[: fb - pad].float())
        return torch.cat(outs)

    def _guided_velocity(
        self,
        model: nn.Module,
        x: Tensor,
        sigma: Tensor,
        cond: Tensor,
        pooled: Tensor,
        uncond: Tensor,
        uncond_pooled: Tensor,
        guidance: Tensor,
    ) -> Tensor:
        """CFG v = v_u + g (v_c - v_u) on rows with g > 1, v_c elsewhere; guidance (R,).
        The unconditional branch always runs without grad (flow_grpo detaches it)."""
        v_c = self.velocity(model, x, sigma, cond, pooled)
        use = guidance > 1.0
        if not bool(use.any()):
            return v_c
        with torch.no_grad():
            v_u = self.velocity(model, x, sigma, uncond, uncond_pooled)
        g = guidance.float().reshape(-1, *([1] * (x.ndim - 1)))
        return torch.where(use.reshape(g.shape), v_u + g * (v_c - v_u), v_c)

    def generate(
        self, prompts: list[dict], group_size: int, sampling: Sampling, seeds: list[int]
    ) -> Rollout:
        """Sample ``group_size`` images (clips) per prompt record ({"prompt": caption}).

        Uses ``sampling.denoise_steps`` steps of ``flow_sigmas``; steps in
        ``sampling.sde_steps`` (None = all) take the ``sampling.sde_type`` step with
        ``sampling.noise_level``, the others the Euler ODE step; ``greedy`` makes every
        step ODE (evaluation). CFG when ``guidance_scale`` > 1. All randomness of a
        prompt's group comes from a generator seeded with its seed: first the initial
        noise (one draw shared by the group), then per SDE step the group's noise.

        Returns a rollout whose A actions are x_{k+1} at the ``sampling.train_steps``
        (None = the SDE steps): actions (N, A, C, H, W) or (N, A, C, F, H, W); logprobs
        (N, A) fp32; mask 1 at stochastic steps, 0 at deterministic ones (greedy/noise 0);
        context {"x": x_k (N, A, ...), "sigma", "sigma_next", "noise_level": (N, A),
        "cond" (N, L, D), "pooled" (N, Dp), "uncond", "uncond_pooled" (the CFG branch's
        embeddings, per sample), "guidance_scale" (N,), "sde_type": str}; outputs PIL
        RGB images or lists of PIL frames.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        steps = int(sampling.denoise_steps)
        sigmas = self._sigmas(steps).to(self.device)
        sde_set, train = plan_steps(sampling, steps)
        g_scale = float(sampling.guidance_scale)
        n, dev = len(prompts) * group_size, self.device

        cond1, pooled1 = self._encode_each([str(r["prompt"]) for r in prompts])
        cond = cond1.repeat_interleave(group_size, 0)
        pooled = pooled1.repeat_interleave(group_size, 0)
        un_c, un_p = self._encode_each([self.cfg_uncond_prompt])
        # contiguous copies: a stride-0 view could take another kernel path than the
        # contiguous rows that logprobs rebuilds, and change the last bits
        uncond = un_c.expand(n, *un_c.shape[1:]).contiguous()
        uncond_pooled = un_p.expand(n, -1).contiguous()
        guidance = torch.full((n,), g_scale, device=dev)

        def velocity(x: Tensor, sigma: Tensor) -> Tensor:
            return self._guided_velocity(
                self.transformer, x, sigma, cond, pooled, uncond, uncond_pooled, guidance
            )

        gens = [seeded_generator(s, dev) for s in seeds]
        x = initial_noise(gens, group_size, self.sample_shape, shared=self.shared_group_noise)
        run = denoise(
            velocity,
            x,
            sigmas,
            gens,
            sde_steps=sde_set,
            train_steps=train,
            sde_type=sampling.sde_type,
            noise_level=0.0 if sampling.greedy else float(sampling.noise_level),
        )
        records = [r for r in prompts for _ in range(group_size)]
        context = {
            "x": run.x,
            "sigma": run.sigma,
            "sigma_next": run.sigma_next,
            "noise_level": run.noise_level,  # (N, A): a at SDE steps, 0 at ODE ones
            "cond": cond,
            "pooled": pooled,
            "uncond": uncond,
            "uncond_pooled": uncond_pooled,
            "guidance_scale": guidance,  # (N,)
            "sde_type": sampling.sde_type,
            # the final samples before any VAE decode, and the sampler's noise levels:
            # what DiffusionNFT trains on (models/flow_nft.py) and latent rewards read
            "x0": run.final,
            "sampler_sigmas": sigmas[:-1].unsqueeze(0).expand(n, -1).contiguous(),
        }
        return Rollout(
            prompt_ids=[str(r.get("id", r["prompt"])) for r in records],
            actions=run.actions,
            logprobs=run.logprobs,
            # a deterministic step (greedy, noise 0, or a trained step outside sde_steps
            # in eval) has no density: it is recorded but not an action
            mask=(run.noise_level > 0).float(),
            context=context,
            outputs=(
                tensor_to_images(self.to_pixels(run.final))
                if self.decode_outputs
                else list(run.final)
            ),
            records=records,
            truncated=torch.zeros(n, dtype=torch.bool),
        )

    def _transitions(self, model: nn.Module, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs (N, A), std (N, A), means (N, A, ...)) of the rollout's transitions
        under ``model``, with the sampler's fp32 math and per-row numerics."""
        ctx = rollout.context
        n, a = rollout.logprobs.shape
        if n * a == 0:
            z = torch.zeros(n, a, device=self.device)
            return z, z, torch.zeros(rollout.actions.shape, device=self.device)

        def per_action(t: Tensor) -> Tensor:  # (N, ...) -> (N*A, ...)
            return t.repeat_interleave(a, 0)

        v = self._guided_velocity(
            model,
            ctx["x"].flatten(0, 1),
            ctx["sigma"].reshape(-1),
            per_action(ctx["cond"]),
            per_action(ctx["pooled"]),
            per_action(ctx["uncond"]),
            per_action(ctx["uncond_pooled"]),
            per_action(ctx["guidance_scale"]),
        )
        _, lp, mu, std = step_fn(ctx["sde_type"])(
            ctx["x"].flatten(0, 1),
            v,
            ctx["sigma"].reshape(-1),
            ctx["sigma_next"].reshape(-1),
            ctx["noise_level"].reshape(-1),
            prev_sample=rollout.actions.flatten(0, 1),
        )
        return lp.reshape(n, a), std.reshape(n, a), mu.reshape(rollout.actions.shape)

    def _transition_logprobs(self, model: nn.Module, rollout: Rollout) -> tuple[Tensor, Tensor]:
        lp, std, _ = self._transitions(model, rollout)
        return lp, std

    def logprobs(
        self, rollout: Rollout, with_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(N, A) log pi(x_{k+1} | x_k) under the current weights, with the sampler's fp32
        math and the same per-row numerics (see the module docstring).

        The entropy of a Gaussian step is per element 0.5 * log(2 pi e std^2): it depends
        only on the noise schedule, not on the weights (no gradient), and is 0 where the
        step was deterministic. For CPS the log-prob is unnormalised, but the entropy of
        its Gaussian N(mu, s^2) is reported the same way.
        """
        lp, std = self._transition_logprobs(self.transformer, rollout)
        if not with_entropy:
            return lp
        return lp, step_entropy(std)

    # ---- KL reference (ReferenceKL, ClosedFormKL; models/flow_kl.py) -----------------------
    def enable_reference(self) -> None:
        """Fix the KL reference: with LoRA and reference="lora_disabled" the base model
        (adapters off) is the reference and nothing is copied; otherwise snapshot a frozen
        copy of the current transformer."""
        lora_base = self.reference == "lora_disabled" and self.lora is not None
        self.kl_reference.enable(self.transformer, lora_base=lora_base)

    def _reference_transitions(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        with self.kl_reference.module(self.transformer) as model:
            return self._transitions(model, rollout)

    def reference_logprobs(self, rollout: Rollout) -> Tensor:
        """(N, A) log pi_ref of the rollout's transitions, no grad."""
        return self._reference_transitions(rollout)[0]

    def attach_reference_means(self, rollout: Rollout) -> Rollout:
        """Store the reference policy's transition means (N, A, ...) in the rollout's
        context ("ref_mean", fp32, no grad) for the closed-form KL of
        ``logprobs_with_kl``; returns the same rollout."""
        rollout.context["ref_mean"] = self._reference_transitions(rollout)[2].detach()
        return rollout

    def logprobs_with_kl(
        self, rollout: Rollout, estimator: str = "closed_form", block: int = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs, entropy, KL) each (N, A): ``logprobs(with_entropy=True)`` plus the
        closed-form KL(pi || pi_ref) of every transition from one forward pass
        (``flow_kl.transition_kl``). Needs ``attach_reference_means`` first."""
        if "ref_mean" not in rollout.context:
            raise RuntimeError("no reference means: call attach_reference_means(rollout) first")
        lp, std, mu = self._transitions(self.transformer, rollout)
        return lp, step_entropy(std), transition_kl(std, mu, rollout.context, estimator, block)

    def reference_velocity(self, x: Tensor, t: Tensor, cond: Tensor, pooled: Tensor) -> Tensor:
        """The KL reference's velocity at (x, t), no grad (DiffusionNFT's KL term)."""
        with self.kl_reference.module(self.transformer) as model:
            return self.velocity(model, x, t, cond, pooled)

    # ---- EMA (models/ema.py) ------------------------------------------------------------
    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.module().named_parameters() if p.requires_grad}

    def ema_update(self, decay: float = 0.9) -> None:
        self.ema.update(decay)

    def ema_state(self) -> dict[str, Tensor] | None:
        return self.ema.state()

    def load_ema_state(self, state: dict[str, Tensor] | None) -> None:
        self.ema.load_state(state)

    def ema_weights(self) -> AbstractContextManager:
        """The EMA weights swapped in (evaluation), restored on exit."""
        return self.ema.swapped_in()

    # ---- supervised flow matching -------------------------------------------------------
    def sft_loss(
        self,
        records: list[dict],
        *,
        cond_dropout: float = 0.1,
        t_dist: str = "logit_normal",
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Flow-matching loss on target media: records carry "prompt" and "image" (a PIL
        image or a path) or "frames" (a list of PIL frames) for video.

        x_t = (1 - t) x0 + t eps, target v = eps - x0, loss = mean (v_theta(x_t, t) - v)^2,
        t ~ logit-normal(0, 1) (SD3's choice: it favours the mid-noise steps where the
        velocity is hardest to predict). A fraction ``cond_dropout`` of captions is replaced
        by the unconditional prompt so the model also learns the CFG branch.
        """
        key = "frames" if self.family == "wan" else "image"
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"sft_loss: records {missing[:5]} have no {key!r} target")
        dev = self.device
        x0 = images_to_tensor([r[key] for r in records], self.image_size).to(dev)
        if self.vae is not None:  # latent flow matching: targets are VAE latents
            with torch.no_grad():
                x0 = self._follow(self.vae).encode(x0, generator=generator)
            if tuple(x0.shape[1:]) != self.sample_shape:
                raise ValueError(
                    f"sft_loss: targets encode to latents {tuple(x0.shape[1:])}, the sampler "
                    f"uses {self.sample_shape}; check image_size / num_frames"
                )
        b = x0.shape[0]
        drop = torch.rand(b, generator=generator) < cond_dropout
        captions = [
            self.cfg_uncond_prompt if bool(d) else str(r["prompt"]) for r, d in zip(records, drop)
        ]
        cond, pooled = self.encode_prompts(captions)
        if t_dist == "logit_normal":
            t = torch.sigmoid(torch.randn(b, generator=generator)).to(dev)
        elif t_dist == "uniform":
            t = torch.rand(b, generator=generator).to(dev)
        else:
            raise ValueError(f"t_dist must be 'logit_normal' or 'uniform', got {t_dist!r}")
        eps = torch.randn(x0.shape, generator=generator).to(dev)
        tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
        xt = (1.0 - tb) * x0 + tb * eps
        v = self._forward(self.transformer, xt, t, cond, pooled).float()
        return ((v - (eps - x0)) ** 2).mean()
