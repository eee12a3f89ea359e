"""The engine-owned adapter protocols: what each built-in adapter implements, the
capability errors, and the import direction between the engine and the adapters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from bandit_policy import BanditPolicy

from mmyatt.protocols import (
    EMA,
    ClosedFormKL,
    LatentOutputs,
    Policy,
    ReferenceKL,
    SupervisedPolicy,
    protocol_methods,
    require,
)

ROOT = Path(__file__).resolve().parents[1]


def _implements(cls: type, protocol: type) -> bool:
    return all(hasattr(cls, n) for n in protocol_methods(protocol) if n != "decode_outputs")


@pytest.mark.parametrize(
    ("module", "name", "capabilities"),
    [
        ("mmyatt.models.text", "TextPolicy", {ReferenceKL, SupervisedPolicy}),
        ("mmyatt.models.vlm", "VLMPolicy", {ReferenceKL, SupervisedPolicy}),
        (
            "mmyatt.models.flow",
            "FlowPolicy",
            {ReferenceKL, ClosedFormKL, EMA, SupervisedPolicy},
        ),
    ],
)
def test_builtin_adapters_implement_policy_in_full_and_their_capabilities(
    module, name, capabilities
):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert _implements(cls, Policy)
    for capability in (ReferenceKL, ClosedFormKL, EMA, SupervisedPolicy):
        assert _implements(cls, capability) == (capability in capabilities), capability


def test_capabilities_are_checked_with_isinstance_and_name_what_is_missing():
    policy = BanditPolicy()
    assert isinstance(policy, Policy) and isinstance(policy, ReferenceKL)
    assert not isinstance(policy, (ClosedFormKL, EMA, LatentOutputs))
    require(policy, ReferenceKL, "kl")  # no error
    with pytest.raises(TypeError, match="model.ema_decay=0.9 needs .* EMA .* lacks ema_state"):
        require(policy, EMA, "model.ema_decay=0.9")
    with pytest.raises(TypeError, match="LatentOutputs capability; BanditPolicy lacks decode"):
        require(policy, LatentOutputs, "rewards that read latents")
    assert protocol_methods(ClosedFormKL) == [
        "attach_reference_means",
        "enable_reference",
        "logprobs_with_kl",
        "reference_logprobs",
    ]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "mmyatt":
            names.update(f"mmyatt.{a.name}" for a in node.names)  # from mmyatt import nft
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


SIBLINGS = ("mmyatt.models", "mmyatt.datasets", "mmyatt.rewards")


def _engine_imports(path: Path) -> set[str]:
    return {m for m in _imports(path) if m.startswith("mmyatt.") and not m.startswith(SIBLINGS)}


def _file_of(module: str) -> Path:
    path = ROOT / "mmyatt" / module.split(".", 1)[1].replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_leaf(module: str) -> bool:
    """``module`` imports nothing of the engine beyond the protocols, the rollout and its
    own package's leaf modules."""
    path = _file_of(module)
    if not path.is_file():
        return True  # a name imported from a package, checked with the package
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    inside = {m for m in _engine_imports(path) if m.startswith(package + ".") and m != module}
    allowed = inside | {"mmyatt.protocols", "mmyatt.rollout"}
    return _engine_imports(path) <= allowed and all(_is_leaf(m) for m in inside)


def test_adapters_import_only_engine_modules_that_import_no_adapter():
    """models/ -> mmyatt/ goes to the protocols, the rollout and leaf helpers (math that
    imports nothing of the engine or the adapters): no import cycle between them."""
    for path in sorted((ROOT / "models").glob("*.py")):
        for module in sorted(_engine_imports(path)):
            engine_file = _file_of(module)
            deps = _imports(engine_file)
            assert not any(d.startswith("mmyatt.models") for d in deps), (path.name, module)
            if module not in ("mmyatt.protocols", "mmyatt.rollout"):  # a leaf helper
                assert _is_leaf(module), (path.name, module)
    assert _engine_imports(ROOT / "mmyatt" / "protocols.py") == {"mmyatt.rollout"}
    assert not _engine_imports(ROOT / "mmyatt" / "rollout.py")


def test_the_engine_does_not_probe_policies_with_hasattr():
    for name in ("step/controller.py", "step/run.py", "checkpoint/checkpointer.py", "step/sft.py"):
        for node in ast.walk(ast.parse((ROOT / "mmyatt" / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr":
                target = ast.unparse(node.args[0])
                assert "policy" not in target, f"{name}:{node.lineno}: hasattr({target}, ...)"


def test_media_prompts_marks_a_vlm_under_the_engine_wrappers():
    from mmyatt.engines import EnginePolicy
    from mmyatt.engines.vllm_vlm import is_vlm
    from mmyatt.models.vlm import VLMPolicy

    vlm = VLMPolicy.load(str(ROOT / "models" / "builtin" / "tiny_judge"))
    assert is_vlm(vlm) and is_vlm(EnginePolicy(vlm, engine=None))
    assert not is_vlm(BanditPolicy()) and not is_vlm(EnginePolicy(BanditPolicy(), engine=None))
