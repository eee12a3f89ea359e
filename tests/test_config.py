import pytest

from mmyatt.config.schema import ConfigError, RunConfig, dump_yaml, load_config


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    p = write(tmp_path, "name: x\nalgorithm:\n  kl_coef: 0.0\n")
    cfg = load_config(
        p, ["algorithm.kl_coef=0.01", 'sampling.stop=["\\n"]', "optim.betas=[0.9,0.95]"]
    )
    assert isinstance(cfg, RunConfig)
    assert cfg.algorithm.kl_coef == 0.01
    assert cfg.sampling.stop == ("\n",)
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.name == "x"


def test_unknown_key_names_key_and_choices(tmp_path):
    p = write(tmp_path, "algorithm:\n  kl_coeff: 0.1\n")
    with pytest.raises(ConfigError, match=r"algorithm.kl_coeff.*valid keys here:.*kl_coef"):
        load_config(p)


def test_unknown_override_key(tmp_path):
    p = write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match=r"'algorithm.nope'.*valid keys at algorithm"):
        load_config(p, ["algorithm.nope=1"])
    with pytest.raises(ConfigError, match=r"'nosection'"):
        load_config(p, ["nosection.a=1"])


def test_wrong_type_and_literal(tmp_path):
    p = write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match=r"sampling.group_size: expected an integer"):
        load_config(p, ["sampling.group_size=abc"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage: 'ppo' is not one of .*'grpo'"):
        load_config(p, ["algorithm.advantage=ppo"])
    with pytest.raises(ConfigError, match=r"trainer.progress: expected true/false"):
        load_config(p, ["trainer.progress=3"])


def test_cross_field_checks(tmp_path):
    p = write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match="divisible"):
        load_config(p, ["data.prompts_per_step=3", "distributed.nproc=2"])
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config(p, ["algorithm.dual_clip=0.5"])


def test_reward_specs_and_round_trip(tmp_path):
    p = write(
        tmp_path,
        "reward:\n  functions:\n    - {name: exact_match, weight: 0.5}\n"
        "    - {name: format_check, kwargs: {pattern: '\\d+'}}\n",
    )
    cfg = load_config(p)
    assert [f.name for f in cfg.reward.functions] == ["exact_match", "format_check"]
    assert cfg.reward.functions[1].kwargs == {"pattern": "\\d+"}
    again = load_config(write(tmp_path, dump_yaml(cfg)))
    assert again == cfg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "a: [1,\n"))


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files
    for f in files:
        load_config(f)


def test_micro_batch_tokens_checked():
    assert (
        load_config(None, ["algorithm.micro_batch_tokens=512"]).algorithm.micro_batch_tokens == 512
    )
    with pytest.raises(ConfigError, match=r"algorithm.micro_batch_tokens must be >= 0"):
        load_config(None, ["algorithm.micro_batch_tokens=-1"])
    fsdp2 = ["algorithm.micro_batch_tokens=64", "train.backend=fsdp2"]
    assert load_config(None, fsdp2).algorithm.micro_batch_tokens == 64
    with pytest.raises(ConfigError, match=r"needs train.backend=replica or fsdp2 \(got megatron"):
        load_config(None, ["algorithm.micro_batch_tokens=64", "train.backend=megatron"])
    with pytest.raises(ConfigError, match=r"algorithm.name=diffusion_nft\); set it to 0"):
        load_config(
            None,
            [
                "algorithm.micro_batch_tokens=64",
                "algorithm.name=diffusion_nft",
                "model.kind=flow",
                "model.path=builtin:tiny_t2i",
            ],
        )
