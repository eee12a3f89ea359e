"""RL algorithms as pure tensor functions, one concept a file; this package names them all.

- ``advantages``: GRPO, Dr. GRPO, RLOO, REINFORCE++ (and ``groups``: their group and
  batch statistics);
- ``losses``: PPO-clip with clip-higher and dual-clip, loss aggregation, entropy;
- ``kl``: the k1 / k2 / k3 KL estimators;
- ``dynamic_sampling`` and ``overlong``: DAPO's group filter, quota and length handling;
- ``flow_steps``: which denoising steps a flow rollout samples stochastically and trains;
- ``nft``: DiffusionNFT's loss on the forward process.

Nothing here knows about modality, policies or the distributed setup. Shapes in
docstrings use B prompts, G samples per prompt, N = B*G samples, A actions, V vocabulary.
Who calls the policy and sums over ranks is ``mmyatt.step``.
"""

from mmyatt.algorithms.advantages import (
    ADVANTAGES,
    Advantages,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mmyatt.algorithms.dynamic_sampling import allocate_quota, group_has_variance
from mmyatt.algorithms.flow_steps import train_step_schedule
from mmyatt.algorithms.groups import Reduce
from mmyatt.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from mmyatt.algorithms.losses import (
    LOSS_AGG_MODES,
    MAX_LOG_RATIO,
    aggregate_loss,
    entropy_from_logits,
    loss_terms,
    masked_mean,
    ppo_clip_loss,
)
from mmyatt.algorithms.overlong import overlong_filter_mask, overlong_penalty
from mmyatt.protocols import CLOSED_FORM_KL

__all__ = [
    "Advantages",
    "ADVANTAGES",
    "CLOSED_FORM_KL",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MAX_LOG_RATIO",
    "Reduce",
    "aggregate_loss",
    "allocate_quota",
    "compute_advantages",
    "drgrpo_advantages",
    "entropy_from_logits",
    "group_has_variance",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "loss_terms",
    "masked_mean",
    "overlong_filter_mask",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "train_step_schedule",
]
