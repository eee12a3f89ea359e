"""A synthetic arithmetic task for the text demo: small, deterministic, checkable by rule.

>>> arithmetic_records(2, seed=0)[0].keys()
dict_keys(['prompt', 'answer', 'id'])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

OPS = {
    "+": ("add", lambda a, b: a + b),
    "-": ("sub", lambda a, b: a - b),
    "*": ("mul", lambda a, b: a * b),
}


def _operand_range(digits: int) -> range:
    """Operands with exactly ``digits`` digits (0-9 for one digit)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def count_problems(*, digits: int = 2, ops: Sequence[str] = ("+",)) -> int:
    """How many distinct problems exist.

    >>> count_problems(digits=1, ops=("+", "*"))
    200
    """
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {list(OPS)}, got {list(ops)}")
    return len(ops) * len(_operand_range(digits)) ** 2


def _problem(op: str, a: int, b: int) -> dict:
    name, apply = OPS[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(apply(a, b)), "id": f"{name}-{a}-{b}"}


def arithmetic_records(
    n: int,
    *,
    seed: int,
    digits: int = 2,
    ops: Sequence[str] = ("+",),
    exclude: Iterable[str] | None = None,
) -> list[dict]:
    """``n`` distinct problems drawn uniformly from all ``a <op> b`` with ``digits``-digit
    operands, skipping ids in ``exclude``; the same arguments give the same list.

    Subtraction may give negative answers (``"12-34="`` -> ``"-22"``).

    >>> arithmetic_records(1, seed=0, ops=("*",))[0]["id"].startswith("mul-")
    True
    >>> r = arithmetic_records(1, seed=0)[0]
    >>> r["answer"] == str(eval(r["prompt"][:-1]))
    True
    """
    total = count_problems(digits=digits, ops=ops)
    if n > total:
        raise ValueError(
            f"asked for {n} problems but only {total} exist ({digits} digits, {list(ops)})"
        )
    operands = _operand_range(digits)
    pairs = len(operands) ** 2
    exclude = set(exclude or ())
    # Problem i is (ops[i // pairs], a, b) with (a, b) the (i % pairs)-th operand pair. Drawing
    # enough distinct indices to survive the exclusions keeps this O(n), even for huge spaces.
    rng = np.random.default_rng(seed)
    draws = rng.choice(total, size=min(total, n + len(exclude)), replace=False)
    records = []
    for i in draws.tolist():
        pair = i % pairs
        record = _problem(
            ops[i // pairs], operands[pair // len(operands)], operands[pair % len(operands)]
        )
        if record["id"] not in exclude:
            records.append(record)
            if len(records) == n:
                return records
    raise ValueError(
        f"asked for {n} problems but only {len(records)} exist after excluding "
        f"{len(exclude)} ids ({digits} digits, {list(ops)})"
    )


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
    """Write one JSON object per line (UTF-8), creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_arithmetic_task(
    out_dir: str | os.PathLike,
    *,
    n_train: int,
    n_eval: int,
    seed: int,
    digits: int = 2,
    ops: Sequence[str] = ("+",),
    n_val: int = 0,
) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl`` with disjoint problems,
    and with ``n_val`` > 0 ``out_dir/val.jsonl`` disjoint from both (for choices made
    during a run, such as the SFT stopping check, so they never look at the reported eval).

    Eval is drawn first, so its problems do not change with ``n_train``. Returns
    ``(train_path, eval_path)``.
    """
    total = count_problems(digits=digits, ops=ops)
    if n_train + n_eval + n_val > total:
        raise ValueError(
            f"asked for {n_train} train + {n_eval} eval + {n_val} val problems but only "
            f"{total} exist ({digits} digits, {list(ops)})"
        )
    eval_records = arithmetic_records(n_eval, seed=seed, digits=digits, ops=ops)
    taken = {r["id"] for r in eval_records}
    val_records = []
    if n_val:
        val_records = arithmetic_records(
            n_val, seed=seed + 1, digits=digits, ops=ops, exclude=taken
        )
        taken |= {r["id"] for r in val_records}
    train_records = arithmetic_records(n_train, seed=seed, digits=digits, ops=ops, exclude=taken)
    out_dir = Path(out_dir)
    if n_val:
        write_jsonl(out_dir / "val.jsonl", val_records)
    return (
        write_jsonl(out_dir / "train.jsonl", train_records),
        write_jsonl(out_dir / "eval.jsonl", eval_records),
    )
