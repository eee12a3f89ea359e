"""The repository speaks only of itself: no tracked file holds an absolute path of the
machine it was made on, a cross-process lock file, an internal tracker reference, or
words about how the work was organised (work periods, other people's jobs on the
machine, borrowed hardware and its time allowance). Also: every ``*.md`` a tracked file
names exists in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = "tests/test_tracked_files.py"

# absolute home or work directories of a machine; a URL's path ("host.org/home/x") is
# preceded by a word character and does not count
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|home|root|Users|mnt/data)/\w")
# a lock file shared between processes on one machine
LOCK_FILE = re.compile(r"/tmp/[\w.-]*\.lock\b|\bflock\s+(?:-\w+\s+)*/")
# a result file or a built-in model's config holding a temporary path of the run that
# made it (save_pretrained writes "_name_or_path")
DATA_TMP_PATH = re.compile(r"/tmp/\w")

WORK_WORDS = [
    # a work period (a time of day or an ordinal before "session"); HTTP sessions ("requests.Session",
    # "a session object") are not preceded by these words
    re.compile(
        r"\b(?:first|second|third|fourth|fifth|evening|morning|afternoon|night|this|next|"
        r"last|previous|earlier|later|work|one more)\s+sessions?\b",
        re.I,
    ),
    re.compile(r"\bsessions? (?:of|with) (?:device|gpu)\b", re.I),
    re.compile(r"\b(?:other|another) (?:agents?|engineers?)\b|\bagents'", re.I),
    re.compile(r"\bother (?:jobs|people's (?:jobs|runs))\b", re.I),
    re.compile(r"\blent\b", re.I),
    re.compile(r"\bdevice[- ]time\b", re.I),
    # "budget" for machine time; a token, retry or micro-batch budget is legitimate
    re.compile(r"\b(?:device|gpu|machine|lock)[- ]budget\b", re.I),
    re.compile(r"\bbudget was spent\b|\bBUDGET_S\b", re.I),
    # internal tracker numbers used as references
    re.compile(r"\bissues? #?\d+\b", re.I),
    re.compile(r"\((?:see )?#\d+\)|\b(?:see|fixes|closes) #\d+\b", re.I),
]

MD_REF = re.compile(r"(?<![\w/.-])([A-Za-z0-9_][\w.-]*\.md)\b")


def tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [f for f in out.decode().split("\0") if f]
    if not files:
        pytest.skip("not a git checkout")
    return [f for f in files if (ROOT / f).is_file()]


def text_of(path: str, root: Path = ROOT) -> str | None:
    try:
        return (root / path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary


def offending_lines(files: list[str], root: Path = ROOT) -> list[str]:
    bad = []
    for f in files:
        if f == THIS:
            continue
        text = text_of(f, root)
        if text is None:
            continue
        patterns = [MACHINE_PATH, LOCK_FILE, *WORK_WORDS]
        if f.startswith("results/") or (f.startswith("models/builtin/") and f.endswith(".json")):
            patterns.append(DATA_TMP_PATH)  # results, and the configs a built-in was saved with
        for n, line in enumerate(text.splitlines(), 1):
            for p in patterns:
                m = p.search(line)
                if m:
                    bad.append(f"{f}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return bad


def test_no_machine_paths_locks_or_words_about_how_the_work_was_done():
    bad = offending_lines(tracked())
    assert not bad, "\n".join(bad)


def test_the_scan_finds_what_it_is_for(tmp_path):
    """Each kind of line fails the scan, and the legitimate uses next to them pass."""
    # the offending lines are put together here, so that this file does not hold them
    bad = {
        "a.md": " ".join(("measured in the", "evening", "session on the GPU")),
        "b.py": 'raise ValueError("not implemented (' + "issue" + ' 14)")',
        "c.sh": "flock " + "/tmp/mmyatt-heavy" + ".lock python bench.py",
        "d.json": '{"measured": "' + "/" + "work/main/bench/placement.json" + '"}',
        "e.md": " ".join(("other", "agents'", "jobs shared the cores")),
        "f.md": " ".join(("on a", "lent", "GPU")),
        "g.md": " ".join(("15 minutes of", "device", "time")),
        "h.md": "the afternoon's budget was spent before it finished",
        "h2.sh": "DEADLINE=$((SECONDS + ${BUDGET_S:-540}))",
        "results/i.json": '{"run": "/tmp/nft/grpo_test"}',
        "j.py": 'msg = "see #14"',
        "k.md": "cached under /home/someone/.cache",
        "k2.md": "2 CPU cores under load from " + "other" + " jobs (load average 12)",
    }
    good = {
        "l.py": "client = requests.Session()  # one HTTP session per judge",
        "m.md": "samples the token budget cut; the retry budget is spent; budget 512 tokens",
        "m2.py": 'why = "time budget (trainer.max_minutes)"',
        "n.md": "see https://example.org/home/page and the micro-batch budget",
        "o.md": "files in /tmp on ext4; a session object; the equivalent call",
        "o2.md": "2 CPU cores under load (load average 12); other runs of the same recipe",
    }
    for name, line in {**bad, **good}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(line + "\n")
    found = offending_lines(list(bad) + list(good), tmp_path)
    assert {f.split(":")[0] for f in found} == set(bad), "\n".join(found)


def test_every_markdown_file_named_exists():
    files = tracked()
    names = {Path(f).name for f in files if f.endswith(".md")}
    missing = []
    for f in files:
        if f == THIS or not f.endswith((".md", ".py", ".sh", ".yaml", ".ipynb", ".toml")):
            continue
        text = text_of(f) or ""
        for n, line in enumerate(text.splitlines(), 1):
            for m in MD_REF.finditer(line):
                if m.group(1) not in names:
                    missing.append(f"{f}:{n}: {m.group(1)}")
    assert not missing, "\n".join(missing)
