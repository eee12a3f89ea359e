"""Policy adapters a user trains, installed as ``mmyatt.models``: one module a concept.

``text`` (causal LMs), ``vlm`` (Qwen2-VL family; prompts and media in ``vlm_inputs``,
positions and the forward in ``vlm_forward``, vision features in ``vlm_features``),
``flow`` (flow-matching generators; its SDE in ``flow_sde``, its denoising loop in
``flow_sampler``, loading and saving in ``flow_io`` / ``flow_pipeline``, the KL reference
in ``flow_kl``, DiffusionNFT in ``flow_nft``), ``ema`` and the judges served to rewards
(``judge``). The shared decode loop is ``decode``; CPU attention kernels ``cpu_kernels``.
Each implements the protocols of :mod:`mmyatt.protocols`; import the module you need
(``from mmyatt.models.text import TextPolicy``): this package imports none of them, so
importing it pulls in neither torch nor transformers. The tiny built-in models and how
each was made live in ``builtin``.
"""
