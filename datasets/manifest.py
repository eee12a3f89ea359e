"""Sharded JSONL manifests: each rank parses only the records it owns.

A manifest is one or more JSONL files, one record per non-blank line. Records are numbered
over the concatenation of the files (blank lines not counted); that number is the record's
global index. Every epoch has a seeded permutation of the global indices, and the epochs
laid end to end form one global stream::

    stream = perm(epoch 0) ++ perm(epoch 1) ++ ...

Rank ``r`` of ``P`` owns stream positions ``r, r + P, r + 2P, ...``. In epoch 0 that is
``perm[r::P]``; in later epochs the start shifts by ``epoch * len(manifest) % P``, which is
what makes batch ``k`` of ``P`` ranks (``n`` records each) the same records as batch ``k`` of
one rank reading ``P * n``, even across epoch boundaries and when ``P`` does not divide the
number of records. The engine relies on that: controllers on half the data each must equal
one controller on all of it.

Building the index only scans bytes for newlines; ``json.loads`` (and the ``transform``
hook, where images and videos get decoded) runs only on this rank's own records.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger("mmyatt.datasets")

BAD_LINE_POLICIES = ("fail", "skip")
_NEWLINE = ord("\n")
_IS_TEXT = np.ones(256, dtype=bool)  # byte value -> counts as content (not whitespace)
_IS_TEXT[list(b" \t\r\n\f\v")] = False
_CHUNK_BYTES = 1 << 22  # 4 MiB: the per-chunk int32 prefix sums stay around 16 MiB


class ManifestError(ValueError):
    """A bad manifest record; the message starts with ``"path:lineno: "``."""


def index_lines(path: str, chunk_bytes: int = _CHUNK_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and 1-based line numbers of the non-blank lines of ``path``.

    Returns ``(starts, linenos)``, both int64 arrays of shape (num_records,). Reads raw bytes
    in chunks and never decodes them, so indexing a large manifest is cheap on every rank.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
    ...     _ = f.write(b'{"a": 1}\\n\\n  \\n{"a": 2}')
    >>> starts, linenos = index_lines(f.name)
    >>> starts.tolist(), linenos.tolist()
    ([0, 13], [1, 4])
    """
    starts: list[np.ndarray] = []
    linenos: list[np.ndarray] = []
    chunk_start = 0  # file offset of the current chunk
    line_start = 0  # file offset where the line carried over from earlier chunks began
    line_has_text = False  # whether that carried-over line has a non-blank byte so far
    lines_before = 0  # complete lines before the current chunk
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            buf = np.frombuffer(chunk, dtype=np.uint8)
            newlines = np.flatnonzero(buf == _NEWLINE)
            # Line segments of this chunk: [seg_begin, seg_end). All but the last end in "\n";
            # the first one continues the line carried over from the previous chunk.
            seg_begin = np.concatenate([[0], newlines + 1])
            seg_end = np.concatenate([newlines, [len(buf)]])
            text_before = np.concatenate([[0], np.cumsum(_IS_TEXT[buf], dtype=np.int32)])
            seg_has_text = text_before[seg_end] > text_before[seg_begin]
            seg_has_text[0] |= line_has_text
            file_begin = chunk_start + seg_begin
            file_begin[0] = line_start
            done = len(newlines)  # complete lines in this chunk
            keep = np.flatnonzero(seg_has_text[:done])
            starts.append(file_begin[keep])
            linenos.append(lines_before + 1 + keep)
            line_start, line_has_text = int(file_begin[done]), bool(seg_has_text[done])
            lines_before += done
            chunk_start += len(buf)
    if line_has_text:  # last line without a trailing newline
        starts.append(np.array([line_start]))
        linenos.append(np.array([lines_before + 1]))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts).astype(np.int64), np.concatenate(linenos).astype(np.int64)


class ShardedManifest:
    """Reads this rank's share of a JSONL manifest, batch by batch, epoch after epoch.

    Example (two ranks reading ``data.jsonl``, 4 records per rank per step)::

        reader = ShardedManifest("data.jsonl", rank=rank, world_size=2, seed=0)
        batch = reader.next_batch(4)  # list of 4 dicts
        batch[0]["_index"], batch[0]["_epoch"], batch[0]["_source"]  # 17, 0, "data.jsonl:18"

    Args:
        paths: one JSONL path or several (concatenated in the given order).
        rank, world_size: this controller and the number of controllers.
        seed: seeds the per-epoch permutation ``default_rng([seed, epoch])``.
        shuffle: False keeps file order in every epoch.
        bad_lines: ``"fail"`` raises :class:`ManifestError`; ``"skip"`` logs a warning,
            counts the record in ``num_skipped`` and reads the next one instead.
        required_keys: keys every record must have.
        transform: applied to each own record after parsing (decode media here); an
            exception from it makes the record bad.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        bad_lines: str = "fail",
        required_keys: Sequence[str] = ("prompt",),
        transform: Callable[[dict], dict] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if bad_lines not in BAD_LINE_POLICIES:
            raise ValueError(f"bad_lines must be one of {BAD_LINE_POLICIES}, got {bad_lines!r}")
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(path) for path in paths]
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.bad_lines = bad_lines
        self.required_keys = tuple(required_keys)
        self.transform = transform
        self._file_ids, self._starts, self._linenos = self._index_files()
        if len(self._starts) == 0:
            raise ManifestError(f"{', '.join(self.paths)}: no records (all files are empty)")
        self._files: dict[int, Any] = {}  # open handles, by file id
        self._perm_epoch, self._perm = -1, np.zeros(0, np.int64)  # cached permutation
        self._warned: set[int] = set()  # global indices already warned about
        self.epoch = 0
        self.pos = 0
        self.num_skipped = 0
        self.num_parsed = 0

    def _index_files(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        file_ids, starts, linenos = [], [], []
        for file_id, path in enumerate(self.paths):
            if not os.path.isfile(path):
                raise FileNotFoundError(errno.ENOENT, "manifest file not found", path)
            file_starts, file_linenos = index_lines(path)
            file_ids.append(np.full(len(file_starts), file_id, np.int32))
            starts.append(file_starts)
            linenos.append(file_linenos)
        return np.concatenate(file_ids), np.concatenate(starts), np.concatenate(linenos)

    def __len__(self) -> int:
        """Number of records in the whole manifest (all ranks together)."""
        return len(self._starts)

    # ---- ownership ----

    def permutation(self, epoch: int) -> np.ndarray:
        """Global indices in the order epoch ``epoch`` visits them, shape (len(self),)."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            else:
                self._perm = np.arange(len(self))
            self._perm_epoch = epoch
        return self._perm

    def _first_owned(self, epoch: int) -> int:
        # Epoch e starts at stream position e * len(self); the first position owned by this
        # rank is the next one congruent to rank modulo world_size.
        return (self.rank - epoch * len(self)) % self.world_size

    def owned_indices(self, epoch: int) -> np.ndarray:
        """Global indices this rank owns in ``epoch``, in reading order."""
        return self.permutation(epoch)[self._first_owned(epoch) :: self.world_size]

    def num_owned(self, epoch: int = 0) -> int:
        """How many records this rank owns in ``epoch`` (differs by at most 1 across ranks)."""
        return len(range(self._first_owned(epoch), len(self), self.world_size))

    # ---- reading ----

    def source(self, index: int) -> str:
        """``"path:lineno"`` of global record ``index`` (1-based line number)."""
        return f"{self.paths[self._file_ids[index]]}:{self._linenos[index]}"

    def _read_raw(self, index: int) -> bytes:
        file_id = int(self._file_ids[index])
        if file_id not in self._files:
            self._files[file_id] = open(self.paths[file_id], "rb")  # kept open across reads
        file = self._files[file_id]
        file.seek(int(self._starts[index]))
        return file.readline()

    def parse_line(self, raw: bytes, source: str) -> dict:
        """Parse one raw JSONL line into a dict; the only place ``json.loads`` runs.

        Raises :class:`ManifestError` starting with ``source`` for invalid JSON, a value that
        is not an object, or a missing required key.
        """
        self.num_parsed += 1
        try:
            # without its newline: a record cut short reads "column 15", not "line 2"
            record = json.loads(raw.rstrip(b"\r\n"))
        except json.JSONDecodeError as error:  # the position within this record's line
            raise ManifestError(
                f"{source}: invalid JSON at column {error.colno}: {error.msg}"
            ) from error
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError, deep nesting
            raise ManifestError(f"{source}: invalid JSON: {error}") from error
        if not isinstance(record, dict):
            raise ManifestError(f"{source}: expected a JSON object, got {type(record).__name__}")
        missing = [key for key in self.required_keys if key not in record]
        if missing:
            raise ManifestError(f"{source}: missing required key {missing[0]!r}")
        return record

    def load_record(self, index: int, epoch: int) -> dict:
        """Parse and transform global record ``index``; raises ManifestError when bad."""
        source = self.source(index)
        record = self.parse_line(self._read_raw(index), source)
        record.update(_index=int(index), _epoch=int(epoch), _source=source)
        if self.transform is None:
            return record
        try:
            record = self.transform(record)
        except Exception as error:
            message = str(error)  # a media error names the record already
            if source not in message:
                message = f"{source}: transform failed: {type(error).__name__}: {error}"
            raise ManifestError(message) from error
        if not isinstance(record, dict):
            raise ManifestError(f"{source}: transform returned {type(record).__name__}, not dict")
        return record

    def _load_or_skip(self, index: int, epoch: int) -> dict | None:
        """The record, or None when it is bad and the policy is "skip"."""
        try:
            return self.load_record(index, epoch)
        except ManifestError as error:
            if self.bad_lines == "fail":
                raise
            self.num_skipped += 1
            if index not in self._warned:  # records recur every epoch; warn once each
                self._warned.add(index)
                logger.warning("skipping bad record: %s", error)
            return None

    def next_batch(self, n: int) -> list[dict]:
        """The next ``n`` records this rank owns, moving into the next epoch as needed.

        Under ``bad_lines="skip"`` bad records are replaced by the following ones, so the
        batch is still full; after ``len(self)`` bad reads in a row (a full pass worth of
        records) it raises ManifestError instead of looping forever.
        """
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch: list[dict] = []
        bad_in_a_row = 0
        while len(batch) < n:
            while self.pos >= self.num_owned(self.epoch):
                self.epoch, self.pos = self.epoch + 1, 0
            index = int(self.owned_indices(self.epoch)[self.pos])
            record = self._load_or_skip(index, self.epoch)
            self.pos += 1
            if record is not None:
                batch.append(record)
                bad_in_a_row = 0
                continue
            bad_in_a_row += 1
            if bad_in_a_row >= len(self):
                raise ManifestError(
                    f"{', '.join(self.paths)}: no valid records after a full pass "
                    f"({bad_in_a_row} bad records in a row on rank {self.rank}; "
                    f"{self.num_skipped} skipped in total)"
                )
        return batch

    def eval_records(self, limit: int | None = None) -> list[dict]:
        """This rank's share for held-out evaluation: records ``rank, rank + P, ...`` in file
        order (no shuffle, epoch 0), at most ``limit`` of them. Does not move the cursor."""
        records: list[dict] = []
        owned = range(self.rank, len(self), self.world_size)
        for index in owned:
            if limit is not None and len(records) >= limit:
                break
            record = self._load_or_skip(index, epoch=0)
            if record is not None:
                records.append(record)
        if not records and len(owned) > 0 and limit != 0:
            raise ManifestError(f"{', '.join(self.paths)}: no valid records on rank {self.rank}")
        return records

    def check_records(self) -> int:
        """Read every record of the manifest once (parse, required keys, transform), as
        a launcher does before any controller starts, so a bad record is an error naming
        its line now rather than in the middle of a run. Returns the number of bad
        records (under ``bad_lines="skip"``; ``"fail"`` raises at the first). The cursor
        does not move."""
        skipped = self.num_skipped
        for index in range(len(self)):
            self._load_or_skip(index, epoch=0)
        bad, self.num_skipped = self.num_skipped - skipped, skipped
        if bad == len(self):
            raise ManifestError(f"{', '.join(self.paths)}: no valid records ({bad} bad)")
        return bad

    def num_bytes(self) -> int:
        """The size of the manifest's files together."""
        return sum(os.path.getsize(path) for path in self.paths)

    # ---- cursor ----

    def state_dict(self) -> dict[str, int]:
        """The cursor as plain ints, e.g. ``{"epoch": 1, "pos": 7, "num_skipped": 0, ...}``."""
        return {
            "epoch": int(self.epoch),
            "pos": int(self.pos),
            "num_skipped": int(self.num_skipped),
            "num_parsed": int(self.num_parsed),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where ``state_dict()`` was taken."""
        missing = {"epoch", "pos", "num_skipped", "num_parsed"} - set(state)
        if missing:
            raise ValueError(f"manifest state is missing keys {sorted(missing)}")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.num_skipped, self.num_parsed = int(state["num_skipped"]), int(state["num_parsed"])

    def close(self) -> None:
        """Close the open file handles (reading again reopens them)."""
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __enter__(self) -> ShardedManifest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_files"):  # __init__ may have failed before opening anything
            self.close()

    def __getstate__(self) -> dict:
        # File handles do not pickle (e.g. into DataLoader workers); they reopen lazily.
        return {**self.__dict__, "_files": {}}
