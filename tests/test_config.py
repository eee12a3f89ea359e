"""Config loading: keys, types, choices and the one-line errors (ranges and the checks
against registries and model folders: tests/test_config_ranges.py)."""

import json
from pathlib import Path

import pytest

import mmyatt.step.run  # noqa: F401  (loads configs with every check a run registers)
from mmyatt.config.schema import ConfigError, RunConfig, build, dump_yaml, load_config

ROOT = Path(__file__).resolve().parent.parent


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
    files = sorted((ROOT / "configs").glob("*.yaml"))
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


def test_sections_are_frozen_and_reject_unknown_keys():
    cfg = load_config(None)
    with pytest.raises(ValueError, match="frozen"):
        cfg.trainer.steps = 3
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.stepz'; valid keys here:"):
        build(RunConfig, {"trainer": {"stepz": 3}})
    copy = cfg.model_copy(update={"name": "other"})
    assert (copy.name, cfg.name) == ("other", "run")


def test_strict_scalars_as_yaml_gives_them():
    with pytest.raises(ConfigError, match=r"trainer.steps: expected an integer, got 2.5"):
        load_config(None, ["trainer.steps=2.5"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a number, got True"):
        load_config(None, ["optim.lr=true"])
    with pytest.raises(ConfigError, match=r"name: expected a string, got 3"):
        load_config(None, ["name=3"])
    # YAML 1.1 reads 3e-3 (no dot) as a string; a number key still takes it
    assert load_config(None, ["optim.lr=3e-3"]).optim.lr == 0.003
    # one string where a list of strings goes is a list of one
    assert load_config(None, ["model.freeze=model.visual"]).model.freeze == ("model.visual",)


def test_an_error_from_the_recipe_names_the_file(tmp_path):
    p = write(tmp_path, "trainer:\n  steps: -3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: trainer.steps must be >= 1, got -3$"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^trainer.steps must be >= 1, got -4$"):
        load_config(p, ["trainer.steps=-4"])  # the command line set it: no file to name


def test_every_error_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "a: [1,\n"))
    assert "invalid YAML" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.stop=[unclosed"])
    assert "invalid YAML" in str(e.value) and "\n" not in str(e.value)


def test_model_folder_checked_against_model_kind(tmp_path):
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    with pytest.raises(
        ConfigError,
        match=r"^model.path=\S+vlm holds a vision-language model \(config.json model_type "
        r"qwen2_vl\), but model.kind=text needs a text model",
    ):
        load_config(None, [f"model.path={vlm}"])
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=r"holds a text model .* model.kind=vlm needs a vision"):
        load_config(None, [f"model.path={text}", "model.kind=vlm"])
    with pytest.raises(ConfigError, match=r"model.path=\S+nowhere: no such folder"):
        load_config(None, [f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"model.path=builtin:tiny_t2i holds a diffusers"):
        load_config(None, ["model.path=builtin:tiny_t2i"])
    assert load_config(None, [f"model.path={text}"]).model.path == str(text)
    (vlm / "config.json").write_text(
        json.dumps({"architectures": ["LlavaForConditionalGeneration"]})
    )
    with pytest.raises(
        ConfigError, match=r"holds a vision-language model \(config.json architectures LlavaFor"
    ):
        load_config(None, [f"model.path={vlm}"])
