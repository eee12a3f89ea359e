"""README's and BENCHMARKS' headline tables against the committed result files.

Every headline table is described once (`tests/results_tables.py`): its header and, for
each row, the text of each figure cell as the committed files under ``results/`` give it
(``None`` marks a label cell: command, split, machine, date). The test
parses the Markdown, finds each table by its header, and checks

* the rows: the same row names as the data describes, no more, no fewer;
* every figure cell: equal to the text made from the result file;
* every label cell: no decimal figure in it that the row's data does not give;
* the result column: the files it names exist.

So a number in these tables cannot drift from its data, and a figure without a committed
file cannot enter them. ``python tests/test_results_tables.py`` prints every table's rows
as the data gives them.
"""

from __future__ import annotations

import re

import pytest
from results_common import ARROW, RESULTS, ROOT
from results_tables import TABLES, recipe_rows

# ---------------------------------------------------------------------------- parsing


def split_row(line: str) -> list[str]:
    """A Markdown table row's cells (split on | outside backticks), ** and spacing dropped."""
    cells, cur, tick = [], "", False
    for ch in line.strip().strip("|"):
        tick = not tick if ch == "`" else tick
        if ch == "|" and not tick:
            cells.append(cur)
            cur = ""
        else:
            cur += ch
    return [re.sub(r"\s+", " ", c.replace("**", "")).strip() for c in [*cells, cur]]


def find_table(text: str, header: list[str]) -> list[list[str]]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and split_row(line) == header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.lstrip().startswith("|"):
                    break
                rows.append(split_row(row))
            return rows
    raise AssertionError(f"no table with the header {header}")


DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+x?")


def check(name: str, text: str | None = None) -> list[str]:
    """The differences between a table as written and as its data gives it."""
    t = TABLES[name]
    text = text if text is not None else (ROOT / t.doc).read_text()
    want = t.rows()
    got = {r[0]: r[1:] for r in find_table(text, t.columns)}
    errors = []
    if set(got) != set(want):
        errors.append(
            f"{name}: rows {sorted(set(got) - set(want))} have no data here; "
            f"rows {sorted(set(want) - set(got))} are missing"
        )
    for key in set(got) & set(want):
        row, exp = got[key], want[key]
        figures = set(DECIMAL.findall(" ".join(e for e in exp if e)))
        for col, cell, e in zip(t.columns[1:], row, [*exp, *[None] * len(row)]):
            if e is not None and cell != e:
                errors.append(f"{name} / {key} / {col}: {cell!r}, the data gives {e!r}")
            elif e is None and set(DECIMAL.findall(cell)) - figures - t.allow:
                errors.append(f"{name} / {key} / {col}: a figure that is not from the data")
        if len(row) != len(t.columns) - 1:
            errors.append(f"{name} / {key}: {len(row) + 1} cells for {len(t.columns)} columns")
        for path in re.findall(r"results/[\w./-]+", " ".join(row)):
            if not (ROOT / path).exists():
                errors.append(f"{name} / {key}: {path} does not exist")
    if t.source and t.source not in text:
        errors.append(f"{name}: {t.doc} does not name {t.source}")
    return errors


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_matches_its_committed_results(name):
    errors = check(name)
    assert not errors, "\n".join(errors)


def test_a_changed_number_fails():
    """Each kind of edit to a table is caught: a figure, a row without data, a decimal
    in a label cell."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    demo = recipe_rows()["`flow_nft_genrm_tiny.yaml` (`make demo`)"][1]
    last = demo.split(ARROW)[1].split()[0]
    assert check(
        "recipes", text.replace(f"{ARROW} {last}", f"{ARROW} {float(last) + 0.001:.3f}", 1)
    )
    lines = text.splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith("| `flow_nft_tiny.yaml`"))
    extra = lines[i].replace("`flow_nft_tiny.yaml` (DiffusionNFT)", "`flow_nft_tiny.yaml`, again")
    assert check("recipes", "\n".join([*lines[: i + 1], extra, *lines[i + 1 :]]))
    label = lines[i].replace("| test,", "| test (0.731),", 1)
    assert label != lines[i]
    assert check("recipes", "\n".join([*lines[:i], label, *lines[i + 1 :]]))


def test_every_results_file_is_named_somewhere():
    """No orphan data: each file under results/ is named by README, BENCHMARKS or the docs
    (or its folder is)."""
    docs = ["README.md", "BENCHMARKS.md", *(str(p) for p in (ROOT / "docs").glob("*.md"))]
    text = "\n".join((ROOT / p).read_text() for p in docs)
    orphans = []
    for p in sorted(RESULTS.rglob("*")):
        if not p.is_file() or p.name == "README.md":
            continue
        rel = str(p.relative_to(ROOT))
        if rel not in text and f"{p.parent.relative_to(ROOT)}/" not in text:
            orphans.append(rel)
    assert not orphans, orphans


def main() -> None:
    for name, t in TABLES.items():
        print(f"\n{name} ({t.doc})\n| {t.header} |")
        try:
            rows = t.rows()
        except OSError as e:
            print(f"(no data: {e})")
            continue
        for key, cells in rows.items():
            print("| " + " | ".join([key, *("?" if c is None else c for c in cells)]) + " |")


if __name__ == "__main__":
    main()
