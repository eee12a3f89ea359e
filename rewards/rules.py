"""Rule rewards: plain functions ``fn(completion, record, **kwargs) -> float``.

``record`` is the manifest record the prompt came from (e.g. ``{"prompt": "12+34=",
"answer": "46"}``). :class:`WeightedReward` combines several of them by name.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmyatt.config.checks import register_check
from mmyatt.config.errors import ConfigError
from mmyatt.datasets import describe_check
from mmyatt.rewards.geneval_check import geneval_check
from mmyatt.rewards.image import IMAGE_REWARDS
from mmyatt.rewards.latent import LATENT_REWARDS

if TYPE_CHECKING:  # torch is imported lazily so `import mmyatt.rewards` stays light
    from torch import Tensor

RewardFn = Callable[..., float]

# A number, optionally negative, optionally with thousands commas ("1,234.5") or decimals.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class RewardError(RuntimeError):
    """A reward function failed or returned a non-number for some sample."""


def exact_match(completion: str, record: dict, key: str = "answer") -> float:
    """1.0 when the completion equals ``record[key]`` up to surrounding whitespace.

    >>> exact_match(" 46\\n", {"answer": "46"}), exact_match("46.0", {"answer": 46})
    (1.0, 0.0)
    """
    return 1.0 if completion.strip() == str(record[key]).strip() else 0.0


def _parse_number(text: str) -> float:
    return float(text.replace(",", ""))


def numeric_match(
    completion: str, record: dict, key: str = "answer", rel_tol: float = 1e-6
) -> float:
    """1.0 when the first number in the completion equals ``record[key]`` numerically.

    >>> numeric_match("The sum is 46.", {"answer": "46"})
    1.0
    >>> numeric_match("1,234.0 apples", {"answer": 1234}), numeric_match("-3", {"answer": "3"})
    (1.0, 0.0)
    >>> numeric_match("no idea", {"answer": "46"})
    0.0
    """
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    target = record[key]
    target = float(target) if isinstance(target, numbers.Real) else _parse_number(str(target))
    return 1.0 if math.isclose(_parse_number(found.group()), target, rel_tol=rel_tol) else 0.0


def format_check(completion: str, record: dict, pattern: str = r"-?\d+") -> float:
    """1.0 when the whole (stripped) completion matches ``pattern``.

    >>> format_check(" 46 ", {}), format_check("46 apples", {})
    (1.0, 0.0)
    >>> format_check("<answer>7</answer>", {}, pattern=r"<answer>.*</answer>")
    1.0
    """
    return 1.0 if re.fullmatch(pattern, completion.strip()) else 0.0


def _boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}``)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unbalanced: no answer


def extract_answer(completion: str) -> str | None:
    """The last ``<answer>...</answer>``, else the last ``\\boxed{...}``, else None.

    >>> extract_answer("think... <answer> 46 </answer>"), extract_answer("so \\\\boxed{46}.")
    (' 46 ', '46')
    """
    tags = _ANSWER_TAG.findall(completion)
    return tags[-1] if tags else _boxed_content(completion)


def answer_tag_match(completion: str, record: dict, key: str = "answer") -> float:
    """Exact match of the tagged answer (``<answer>`` or ``\\boxed{}``); 0.0 when untagged.

    >>> answer_tag_match("12+34 is <answer>46</answer>", {"answer": "46"})
    1.0
    >>> answer_tag_match("\\\\boxed{46}", {"answer": "46"}), answer_tag_match("46", {"answer": "46"})
    (1.0, 0.0)
    """
    answer = extract_answer(completion)
    return 0.0 if answer is None else exact_match(answer, record, key=key)


REGISTRY: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format_check": format_check,
    "answer_tag_match": answer_tag_match,
}

# Rewards that load a torch model, imported by name when a run asks for them, so that a
# process scoring rules only never imports torch.
TORCH_REWARDS = {"shape_critic": "mmyatt.rewards.critic:shape_critic"}

# Open descriptions of images and clips (the VLM + GenRM recipe's independent check and
# its length / false-claim counters), in mmyatt.datasets.describe_check.
DESCRIPTION_REWARDS = {
    "describe_check": "description_check",
    "describe_false_claims": "false_claims",
    "describe_colour": "colour_right",
    "describe_shape": "shape_right",
    "describe_direction": "direction_right",  # a clip's direction alone; an image: none named
    "answer_words": "answer_words",
    "describe_wellformed": "wellformed",  # 1 when the answer parses as a description
    "describe_strict": "strict_check",  # the check of well-formed answers only
    "describe_warm_start": "warm_start_check",  # strict, images and clips half each
}


def resolve_reward(name: str) -> RewardFn:
    """A registry name (``"numeric_match"``) or a user function ``"package.module:function"``.

    >>> resolve_reward("exact_match") is exact_match
    True
    >>> resolve_reward("mmyatt.rewards.rules:format_check") is format_check
    True
    """
    if name in TORCH_REWARDS:
        name = TORCH_REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot load reward {name!r}: {error}") from error
        if not callable(fn):
            raise ValueError(f"reward {name!r} is a {type(fn).__name__}, not a function")
        return fn
    if name in REGISTRY:
        return REGISTRY[name]
    if name in DESCRIPTION_REWARDS:
        return getattr(describe_check, DESCRIPTION_REWARDS[name])
    if name in IMAGE_REWARDS:
        return IMAGE_REWARDS[name]
    if name == "geneval_check":
        return geneval_check
    raise ValueError(
        f"unknown reward {name!r}; use one of "
        f"{sorted(REGISTRY) + sorted(DESCRIPTION_REWARDS) + sorted(IMAGE_REWARDS)} "
        "or a user function as 'package.module:function'"
    )


@register_check
def check_reward_names(cfg) -> None:
    """Every reward the run names resolves (run by ``load_config``): reward.functions
    (where ``genrm`` is the judge) and sft.check."""
    names = [(f"reward.functions[{i}].name", f.name) for i, f in enumerate(cfg.reward.functions)]
    names += [("sft.check", cfg.sft.check)] if cfg.sft.check is not None else []
    for key, name in names:
        if name == "genrm" and key != "sft.check":
            continue
        try:
            resolve_reward(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None


_SPEC_KEYS = {"name", "weight", "kwargs"}


def _describe(completion: str, limit: int = 80) -> str:
    """repr of the completion, cut to ``limit`` characters so errors stay readable."""
    return repr(completion if len(completion) <= limit else completion[: limit - 3] + "...")


def check_batch(outputs: Sequence, records: Sequence, prompt_ids: Sequence | None) -> None:
    """The arguments every batch reward takes must describe the same N samples."""
    if len(outputs) != len(records):
        raise ValueError(f"{len(outputs)} outputs but {len(records)} records")
    if prompt_ids is not None and len(prompt_ids) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(prompt_ids)} prompt ids")


class WeightedReward:
    """A weighted sum of reward functions, each given by a spec (the ``Reward`` protocol).

    >>> reward = WeightedReward([{"name": "numeric_match"},
    ...                          {"name": "format_check", "weight": 0.5}])
    >>> total, parts = reward(["46", "46 apples"], [{"answer": "46"}, {"answer": "46"}])
    >>> total.tolist(), parts["format_check"].tolist()
    ([1.5, 1.0], [1.0, 0.0])

    Raw values are keyed by name; a name used twice gets a suffix (``"format_check#2"``).
    NaN or inf from a function is passed through untouched (the engine counts and skips it).
    """

    def __init__(self, specs: Sequence[Mapping[str, Any]]):
        if not specs:
            raise ValueError("WeightedReward needs at least one reward spec")
        self.terms: list[tuple[str, RewardFn, float, dict]] = []  # (label, fn, weight, kwargs)
        for i, spec in enumerate(specs):
            self.terms.append(self._build_term(i, spec))
        latent = [t[0] for t in self.terms if t[1] in LATENT_REWARDS]
        if latent and len(latent) < len(self.terms):
            raise ValueError(
                f"rewards {latent} read latents and {[t[0] for t in self.terms if t[0] not in latent]} "
                "read decoded outputs; one rollout gives one or the other"
            )
        self.reads_latents = bool(latent)  # rewards/latent.py: rollouts skip the decode
        self.last_verdicts: list[dict] = []  # rules give no verdicts (the Reward protocol)

    def _build_term(self, i: int, spec: Mapping[str, Any]) -> tuple[str, RewardFn, float, dict]:
        unknown = set(spec) - _SPEC_KEYS
        if unknown:
            raise ValueError(
                f"reward spec {i} has unknown keys {sorted(unknown)}; allowed: {sorted(_SPEC_KEYS)}"
            )
        if "name" not in spec:
            raise ValueError(f"reward spec {i} has no 'name'")
        name, weight, kwargs = spec["name"], spec.get("weight", 1.0), dict(spec.get("kwargs") or {})
        if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward spec {i} ({name!r}): weight must be a finite number")
        fn = resolve_reward(name)
        try:  # catch misspelt kwargs now rather than at the first rollout
            inspect.signature(fn).bind("", {}, **kwargs)
        except TypeError as error:
            raise ValueError(f"reward {name!r}: bad kwargs {kwargs}: {error}") from error
        except ValueError:
            pass  # some callables (builtins) have no signature to check
        label, taken = name, {term[0] for term in self.terms}
        copy = 2
        while label in taken:
            label, copy = f"{name}#{copy}", copy + 1
        return label, fn, float(weight), kwargs

    compares_groups = False  # a rule scores each sample on its own

    @property
    def names(self) -> list[str]:
        """Keys of the per-function values returned by ``__call__``."""
        return [label for label, *_ in self.terms]

    def __call__(
        self,
        outputs: Sequence[str],
        records: Sequence[dict],
        prompt_ids: Sequence[str] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Score N completions: returns total (N,) float32 and {name: raw values (N,)}."""
        import torch

        check_batch(outputs, records, prompt_ids)
        total = torch.zeros(len(outputs), dtype=torch.float32)
        parts: dict[str, Tensor] = {}
        for label, fn, weight, kwargs in self.terms:
            values = [
                self._score(label, fn, kwargs, i, outputs[i], records[i], prompt_ids)
                for i in range(len(outputs))
            ]
            parts[label] = torch.tensor(values, dtype=torch.float32)
            total += weight * parts[label]
        return total, parts

    @staticmethod
    def _score(
        label: str,
        fn: RewardFn,
        kwargs: dict,
        i: int,
        completion: str,
        record: dict,
        prompt_ids: Sequence[str] | None,
    ) -> float:
        def where() -> str:
            if "_source" in record:
                return f"record {record['_source']}"
            return f"prompt id {prompt_ids[i]!r}" if prompt_ids is not None else "no source"

        try:
            value = fn(completion, record, **kwargs)
        except Exception as error:
            raise RewardError(
                f"reward {label!r} failed on sample {i} ({where()}), completion "
                f"{_describe(completion)}: {type(error).__name__}: {error}"
            ) from error
        if isinstance(value, numbers.Real):
            return float(value)
        if hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor
            return float(value)
        raise RewardError(
            f"reward {label!r} returned {type(value).__name__} instead of a number on sample "
            f"{i} ({where()}), completion {_describe(completion)}"
        )
