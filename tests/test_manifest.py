"""Sharded JSONL manifests: read isolation, the P-ranks-equal-one-rank identity, bad input."""

from __future__ import annotations

import json
import logging
import pickle
import re

import numpy as np
import pytest

from mmyatt.datasets.manifest import ManifestError, ShardedManifest, index_lines
from mmyatt.datasets.synthetic import (
    arithmetic_records,
    count_problems,
    write_arithmetic_task,
    write_jsonl,
)


def write_lines(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def numbered(tmp_path, n: int, name: str = "data.jsonl", start: int = 0) -> str:
    """A manifest whose record i has {"i": start + i}."""
    lines = [json.dumps({"prompt": f"p{start + i}", "i": start + i}) for i in range(n)]
    return write_lines(tmp_path / name, lines)


def ids(batch: list[dict]) -> list[int]:
    return [record["_index"] for record in batch]


# ---- index ----


def test_index_skips_blank_lines_and_handles_chunk_boundaries(tmp_path):
    raw = b'{"a":1}\n\n   \r\n{"a":2}\r\n\n{"a":3}'  # no trailing newline on the last line
    path = tmp_path / "x.jsonl"
    path.write_bytes(raw)
    expected = ([0, raw.index(b'{"a":2'), raw.index(b'{"a":3')], [1, 4, 6])
    for chunk_bytes in (1, 2, 3, 7, 1 << 20):  # every way a line can straddle chunks
        starts, linenos = index_lines(str(path), chunk_bytes=chunk_bytes)
        assert (starts.tolist(), linenos.tolist()) == expected, chunk_bytes


def test_records_span_files_with_sources(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", ['{"prompt": "a1"}', "", '{"prompt": "a2"}'])
    b = write_lines(tmp_path / "b.jsonl", ["", '{"prompt": "b1"}'])
    reader = ShardedManifest([a, b], shuffle=False)
    assert len(reader) == 3
    batch = reader.next_batch(3)
    assert [r["prompt"] for r in batch] == ["a1", "a2", "b1"]
    assert [r["_source"] for r in batch] == [f"{a}:1", f"{a}:3", f"{b}:2"]
    assert ids(batch) == [0, 1, 2] and {r["_epoch"] for r in batch} == {0}


# ---- ownership ----


def test_rank_parses_only_its_own_records(tmp_path):
    path = numbered(tmp_path, 21)
    reader = ShardedManifest(path, rank=0, world_size=2, seed=3)
    parsed: list[int] = []
    original = reader.parse_line

    def spy(raw: bytes, source: str) -> dict:
        record = original(raw, source)
        parsed.append(record["i"])
        return record

    reader.parse_line = spy
    batch = reader.next_batch(4) + reader.next_batch(3)
    owned = np.random.default_rng([3, 0]).permutation(21)[0::2]
    assert parsed == owned[:7].tolist() == ids(batch)
    other_rank = set(np.random.default_rng([3, 0]).permutation(21)[1::2].tolist())
    assert not other_rank & set(parsed)
    assert reader.num_parsed == 7


@pytest.mark.parametrize("num_records", [12, 13])  # P divides N, and not
def test_ranks_together_read_what_one_rank_reads(tmp_path, num_records):
    path = numbered(tmp_path, num_records)
    single = ShardedManifest(path, seed=7)
    ranks = [ShardedManifest(path, rank=r, world_size=2, seed=7) for r in range(2)]
    epochs_seen = set()
    for _ in range(9):  # 9 steps x 6 records crosses 4 epochs
        whole = single.next_batch(6)
        halves = [rank.next_batch(3) for rank in ranks]
        union = [(r["_epoch"], r["_index"]) for half in halves for r in half]
        assert sorted(union) == sorted((r["_epoch"], r["_index"]) for r in whole)
        epochs_seen |= {epoch for epoch, _ in union}
    assert len(epochs_seen) >= 2
    # Each epoch visits every record exactly once across ranks.
    assert single.num_owned(0) == num_records
    assert sum(rank.num_owned(1) for rank in ranks) == num_records


def test_more_ranks_than_records_still_reads(tmp_path):
    path = numbered(tmp_path, 1)
    reader = ShardedManifest(path, rank=1, world_size=2)
    assert reader.num_owned(0) == 0 and reader.num_owned(1) == 1
    assert [r["_epoch"] for r in reader.next_batch(2)] == [1, 3]


def test_seed_determines_order(tmp_path):
    path = numbered(tmp_path, 30)

    def order(seed: int) -> list[int]:
        return ids(ShardedManifest(path, seed=seed).next_batch(45))

    assert order(1) == order(1)
    assert order(1) != order(2)
    first_epoch = order(1)[:30]
    assert sorted(first_epoch) == list(range(30)) and first_epoch != list(range(30))
    assert ids(ShardedManifest(path, shuffle=False).next_batch(35)) == [*range(30), *range(5)]


def test_cursor_round_trip(tmp_path):
    path = numbered(tmp_path, 11)
    reader = ShardedManifest(path, rank=1, world_size=2, seed=5)
    for _ in range(3):
        reader.next_batch(4)
    state = reader.state_dict()
    assert all(type(value) is int for value in state.values())
    assert set(state) == {"epoch", "pos", "num_skipped", "num_parsed"}
    expected = [ids(reader.next_batch(4)) for _ in range(2)]
    resumed = ShardedManifest(path, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [ids(resumed.next_batch(4)) for _ in range(2)] == expected
    assert resumed.num_parsed == reader.num_parsed


def test_eval_records_are_the_rank_share_in_file_order(tmp_path):
    path = numbered(tmp_path, 7)
    reader = ShardedManifest(path, rank=1, world_size=3, seed=9)
    assert ids(reader.eval_records()) == [1, 4]
    assert ids(reader.eval_records(limit=1)) == [1]
    assert reader.state_dict()["pos"] == 0  # evaluation does not move the training cursor


def test_transform_runs_only_on_own_records(tmp_path):
    path = numbered(tmp_path, 10)
    seen = []

    def decode(record: dict) -> dict:
        seen.append(record["_index"])
        return {**record, "pixels": record["i"] * 2}

    reader = ShardedManifest(path, rank=0, world_size=2, transform=decode, shuffle=False)
    batch = reader.next_batch(3)
    assert seen == [0, 2, 4] and [r["pixels"] for r in batch] == [0, 4, 8]


def test_reader_pickles_without_file_handles(tmp_path):
    reader = ShardedManifest(numbered(tmp_path, 5), shuffle=False)
    reader.next_batch(2)
    clone = pickle.loads(pickle.dumps(reader))
    assert ids(clone.next_batch(2)) == ids(reader.next_batch(2)) == [2, 3]
    reader.close()


# ---- bad input ----


def failing_transform(record: dict) -> dict:
    raise OSError("cannot decode image cat.png")


BAD_CASES = {
    "invalid JSON": ('{"prompt": "x"', {}, "invalid JSON"),
    "non-object": ('["prompt"]', {}, "expected a JSON object, got list"),
    "missing key": ('{"text": "x"}', {}, "missing required key 'prompt'"),
    "transform": ('{"prompt": "x"}', {"transform": failing_transform}, "cannot decode image"),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_line_fails_naming_file_and_line(tmp_path, case):
    line, kwargs, message = BAD_CASES[case]
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "", line])
    reader = ShardedManifest(path, shuffle=False, **kwargs)
    if case != "transform":
        assert reader.next_batch(1)[0]["prompt"] == "ok"
        with pytest.raises(ManifestError, match=f"^{re.escape(path)}:3: .*{message}"):
            reader.next_batch(1)
    else:
        expected = f"^{re.escape(path)}:1: transform failed: OSError: {message}"
        with pytest.raises(ManifestError, match=expected):
            reader.next_batch(1)


def test_skip_policy_counts_warns_once_and_fills_batches(tmp_path, caplog):
    lines = ['{"prompt": "a"}', "not json", "[1]", '{"other": 1}', '{"prompt": "b"}']
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    reader = ShardedManifest(path, shuffle=False, bad_lines="skip")
    with caplog.at_level(logging.WARNING, logger="mmyatt.datasets"):
        batch = reader.next_batch(2)
        assert [r["prompt"] for r in batch] == ["a", "b"]
        assert reader.num_skipped == 3
        assert [r["prompt"] for r in reader.next_batch(4)] == ["a", "b", "a", "b"]
    assert reader.num_skipped == 9  # counted every time; warned once per record
    warnings = [r.getMessage() for r in caplog.records if r.name == "mmyatt.datasets"]
    assert len(warnings) == 3
    assert any(f"{path}:2: invalid JSON" in w for w in warnings)
    assert any(f"{path}:4: missing required key 'prompt'" in w for w in warnings)
    assert reader.state_dict()["num_skipped"] == 9


def test_skip_policy_with_a_bad_transform(tmp_path):
    path = numbered(tmp_path, 4)

    def odd_only(record: dict) -> dict:
        if record["i"] % 2 == 0:
            raise ValueError("even")
        return record

    reader = ShardedManifest(path, shuffle=False, bad_lines="skip", transform=odd_only)
    assert [r["i"] for r in reader.next_batch(3)] == [1, 3, 1]


@pytest.mark.parametrize("world_size", [1, 2])
def test_all_bad_file_raises_instead_of_looping(tmp_path, world_size):
    path = write_lines(tmp_path / "bad.jsonl", ["nope", "{", "[]"])
    reader = ShardedManifest(path, bad_lines="skip", world_size=world_size)
    with pytest.raises(ManifestError, match="no valid records after a full pass"):
        reader.next_batch(1)
    with pytest.raises(ManifestError, match="no valid records"):
        reader.eval_records()
    with pytest.raises(ManifestError, match=f"^{re.escape(path)}:1: invalid JSON"):
        ShardedManifest(path, shuffle=False).next_batch(1)


def test_missing_file_names_the_path(tmp_path):
    good = numbered(tmp_path, 2)
    missing = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        ShardedManifest([good, missing])


def test_empty_manifest_is_an_error(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ManifestError, match="empty.jsonl: no records"):
        ShardedManifest(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bad_lines": "ignore"}, r"bad_lines must be one of \('fail', 'skip'\)"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, 2\)"),
        ({"rank": -1}, "rank must be in"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedManifest(numbered(tmp_path, 2), **kwargs)


# ---- synthetic task ----


def test_arithmetic_records_are_correct_unique_and_deterministic():
    records = arithmetic_records(200, seed=4, ops=("+", "-", "*"))
    assert records == arithmetic_records(200, seed=4, ops=("+", "-", "*"))
    assert len({r["id"] for r in records}) == 200
    for record in records:
        expression = record["prompt"].removesuffix("=")
        assert str(eval(expression)) == record["answer"]  # noqa: S307 - our own digits and ops
    first = records[0]
    op = first["prompt"][2]
    a, b = first["prompt"].removesuffix("=").split(op)
    name = {"+": "add", "-": "sub", "*": "mul"}[op]
    assert first["id"] == f"{name}-{a}-{b}" and len(a) == len(b) == 2


def test_arithmetic_exclude_and_exhaustion():
    assert count_problems(digits=1) == 100
    everything = arithmetic_records(100, seed=0, digits=1)
    assert len({r["id"] for r in everything}) == 100
    half = {r["id"] for r in everything[:50]}
    rest = arithmetic_records(50, seed=1, digits=1, exclude=half)
    assert not half & {r["id"] for r in rest}
    with pytest.raises(ValueError, match="only 100 exist"):
        arithmetic_records(101, seed=0, digits=1)
    with pytest.raises(ValueError, match="after excluding"):
        arithmetic_records(51, seed=0, digits=1, exclude=half)
    with pytest.raises(ValueError, match="ops must be"):
        arithmetic_records(1, seed=0, ops=("/",))


def test_write_arithmetic_task(tmp_path):
    train, evals = write_arithmetic_task(tmp_path / "task", n_train=40, n_eval=10, seed=2)
    assert (train.name, evals.name) == ("train.jsonl", "eval.jsonl")
    train_ids = [json.loads(line)["id"] for line in train.read_text().splitlines()]
    eval_ids = [json.loads(line)["id"] for line in evals.read_text().splitlines()]
    assert len(train_ids) == 40 and len(eval_ids) == 10 and not set(train_ids) & set(eval_ids)
    # Eval is drawn first: it does not depend on n_train.
    _, evals_again = write_arithmetic_task(tmp_path / "again", n_train=5, n_eval=10, seed=2)
    assert evals_again.read_text() == evals.read_text()
    assert len(ShardedManifest(str(train))) == 40
    with pytest.raises(ValueError, match="only 100 exist"):
        write_arithmetic_task(tmp_path / "big", n_train=95, n_eval=10, seed=0, digits=1)


def test_write_jsonl_round_trip(tmp_path):
    path = write_jsonl(tmp_path / "sub" / "x.jsonl", [{"prompt": "é"}, {"prompt": "b"}])
    assert [r["prompt"] for r in ShardedManifest(path, shuffle=False).next_batch(2)] == ["é", "b"]


def test_a_manifest_path_holding_a_comma_is_one_file_and_a_list_still_splits(tmp_path):
    from mmyatt.step.builders import manifest_paths

    odd = tmp_path / "run,with_comma" / "train.jsonl"
    odd.parent.mkdir()
    odd.write_text('{"prompt": "a"}\n')
    other = tmp_path / "b.jsonl"
    other.write_text('{"prompt": "b"}\n')
    assert manifest_paths(str(odd)) == [str(odd)]
    assert manifest_paths(f"{other}, {tmp_path / 'c.jsonl'}") == [
        str(other),
        str(tmp_path / "c.jsonl"),
    ]
