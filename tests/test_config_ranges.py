"""Values no run can use fail at load, each with one line that names the key and what it
accepts: ranges, group sizes an algorithm needs, names checked against the registries."""

import re

import pytest

import mmyatt.step.run  # noqa: F401  (loads configs with every check a run registers)
from mmyatt.config.checks import CHECKS
from mmyatt.config.schema import ConfigError, load_config

BAD = [
    # (overrides, the whole message: the key, the value and what the key accepts)
    (["trainer.steps=-3"], r"trainer.steps must be >= 1, got -3"),
    (["trainer.steps=0"], r"trainer.steps must be >= 1, got 0"),
    (["optim.lr=0"], r"optim.lr must be > 0, got 0"),
    (["sft.lr=-1e-3"], r"sft.lr must be > 0, got -1e-3"),
    (["algorithm.kl_coef=-1"], r"algorithm.kl_coef must be >= 0, got -1"),
    (["algorithm.entropy_coef=-0.1"], r"algorithm.entropy_coef must be >= 0, got -0.1"),
    (["algorithm.clip_low=-0.2"], r"algorithm.clip_low must be >= 0, got -0.2"),
    (["algorithm.dual_clip=0.5"], r"algorithm.dual_clip must be > 1, got 0.5"),
    (["distributed.nproc=0"], r"distributed.nproc must be >= 1, got 0"),
    (["sampling.group_size=0"], r"sampling.group_size must be >= 1, got 0"),
    (
        ["sampling.group_size=1"],
        r"algorithm.advantage=grpo compares each sample with its group, so "
        r"sampling.group_size must be >= 2, got 1 \(or use reinforce_pp\)",
    ),
    (
        ["sampling.group_size=1", "algorithm.advantage=reinforce_pp", "train.backend=fsdp2"],
        r"train.backend=fsdp2 needs sampling.group_size >= 2 .*",
    ),
    (["sampling.top_p=1.5"], r"sampling.top_p must be in \(0, 1\], got 1.5"),
    (["sampling.temperature=0"], r"sampling.temperature must be > 0, got 0"),
    (["sft.stop_at_accuracy=1.2"], r"sft.stop_at_accuracy must be in \[0, 1\], got 1.2"),
    (["model.ema_decay=1.0"], r"model.ema_decay must be in \[0, 1\), got 1.0"),
    (["optim.betas=[0.9, 1.5]"], r"optim.betas\[1\] must be in \[0, 1\), got 1.5"),
    (
        ["rollout.gpu_memory_utilization=0"],
        r"rollout.gpu_memory_utilization must be in \(0, 1\], got 0",
    ),
    (["placement.cores=[0, -1]"], r"placement.cores\[1\] must be >= 0, got -1"),
    (["algorithm.ppo_epochs=0"], r"algorithm.ppo_epochs must be >= 1, got 0"),
    (["checkpoint.keep_last=0"], r"checkpoint.keep_last must be >= 1, got 0"),
    (["reward.judge.timeout_s=0"], r"reward.judge.timeout_s must be > 0, got 0"),
    (
        ["reward.functions=[{name: nosuchreward}]"],
        r"reward.functions\[0\].name: unknown reward 'nosuchreward'; use one of \[.*'numeric_match'.*",
    ),
    (["sft.check=nosuchcheck"], r"sft.check: unknown reward 'nosuchcheck'; use one of .*"),
    (
        ["reward.functions=[{name: genrm}]"],
        r"reward.functions has genrm but no judge is configured: set reward.judge.model .*",
    ),
    (
        ["reward.functions=[{name: genrm}]", "reward.judge.model=builtin:no_judge"],
        r"reward.judge.model=builtin:no_judge: no built-in checkpoint 'no_judge'; "
        r"built-ins: .*tiny_judge.*",
    ),
    (
        ["reward.functions=[{name: genrm}]", "reward.judge.model=/no/such/judge"],
        r"reward.judge.model=/no/such/judge: no such folder",
    ),
    (["logging.trackers=[tensorboard, tensorboard]"], r"logging.trackers=.* names a tracker twice"),
    (["algorithm.kl_coef=.inf"], r"algorithm.kl_coef: expected a finite number, got inf"),
    (["reward.functions=[{name: ''}]"], r"reward.functions\[0\].name must not be empty"),
    (["algorithm.advantage=ppo"], r"algorithm.advantage: 'ppo' is not one of 'grpo', .*"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
    assert re.fullmatch(message, str(e.value)), str(e.value)


def test_the_edges_of_each_range_load():
    cfg = load_config(
        None,
        [
            "trainer.steps=1",
            "algorithm.kl_coef=0",
            "sampling.top_p=1",
            "sampling.group_size=1",
            "algorithm.advantage=reinforce_pp",
            "model.ema_decay=0",
            "placement.judge_threads=-1",
            "optim.betas=[0, 0.999]",
        ],
    )
    assert (cfg.trainer.steps, cfg.sampling.group_size, cfg.optim.betas) == (1, 1, (0.0, 0.999))


def test_a_run_registers_every_check_against_the_world():
    """mmyatt.step.run loads the config; every module with a check is imported by then."""
    assert {name.rsplit(".", 1)[1] for name in CHECKS} >= {
        "check_engines",
        "check_tracker_packages",
        "check_placement",
        "check_reward_names",
        "check_builtin_paths",
    }
