"""Counts of what crosses the project's boundaries without being written down, read
from the source by AST (no import of the project):

* undeclared members: ``x.name`` where ``x`` is a policy or reward (by its name:
  ``policy``, ``inner``, ``reward``, ...) and ``name`` is declared by no protocol of
  :mod:`mmyatt.protocols`;
* probes: ``hasattr`` / ``getattr`` on a policy or reward, or asking any object for a
  member a protocol declares; ``__getattr__`` forwarding;
* private reaches: ``x._name`` where ``x`` is not ``self`` / ``cls`` (another object's
  private state), minus the third-party internals named in ``THIRD_PARTY_PRIVATE``;
* function-level imports of the project's own modules;
* file import cycles (strongly connected files, imports at any level).

Variables are recognised by name, not by type: the counts are as good as the names
the code gives its objects, which is why the house style asks for role names.

    .venv/bin/python tests/boundaries.py [--protocols FILE] [paths...]  # every count and hit
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"mmyatt": "mmyatt", "models": "mmyatt.models", "rewards": "mmyatt.rewards"}
PACKAGES["datasets"] = "mmyatt.datasets"

# protocol members whose names other objects have too (a PIL image's ``save``, argparse's
# ``device``): asking an arbitrary object for these is not taken for probing a policy
COMMON_NAMES = {"name", "device", "save", "module"}
POLICY_NAMES = {"policy", "inner", "_inner", "adapter", "wrapped", "pol"}
REWARD_NAMES = {"reward", "_reward", "rewards_fn"}
HELD = POLICY_NAMES | REWARD_NAMES

# Private members of third-party objects the engine must read (torch's in-place version
# counter, transformers' / diffusers' model metadata, CPython's frame access).
THIRD_PARTY_PRIVATE = {
    "_version",  # torch.Tensor: bumped by every in-place update (weight-sync detection)
    "_no_split_modules",  # transformers / diffusers: blocks FSDP2 must not split
    "_attn_implementation",  # transformers config: which attention kernel runs
    "_is_protocol",  # typing: whether a class is a Protocol
    "_getframe",  # sys
    "_C",  # torch
    "_dynamo",  # torch
    "_fields",  # namedtuple
    "_asdict",  # namedtuple
    "_replace",  # namedtuple
    "_exit",  # os: leave a forked child without running parent cleanups
    "_GLOBAL_MEMORY_BUFFER",  # megatron-core's allocator, replaced on a CPU-only torch
}


def library_files(roots: Iterable[str] = ("mmyatt", "models", "rewards", "datasets")) -> list[Path]:
    out = []
    for name in roots:
        path = ROOT / name
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [p for p in out if ".venv" not in p.parts]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES.get(parts[0], parts[0])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def declared_members(protocols: Path = ROOT / "mmyatt" / "protocols.py") -> set[str]:
    """Every method, property and attribute a Protocol class of ``protocols`` declares."""
    names: set[str] = set()
    for node in ast.parse(protocols.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any("Protocol" in ast.unparse(b) or _is_protocol_base(b) for b in node.bases):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
    return names


def _is_protocol_base(base: ast.expr) -> bool:
    return isinstance(base, ast.Name) and base.id[:1].isupper()


def _holder(node: ast.expr) -> str | None:
    """The role name of ``node`` when it names a policy or a reward (``policy``,
    ``self.policy``, ``ctl.reward``; not a config section such as ``cfg.reward``)."""
    if isinstance(node, ast.Name) and node.id in HELD:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in HELD:
        return None if ast.unparse(node.value).endswith("cfg") else node.attr
    return None


def _built_here(tree: ast.AST) -> set[int]:
    """Members read on names a function binds to an object it constructs
    (``policy = FlowPolicy.load(...)``, ``reward = GenRMReward(...)``): an object a
    function builds itself is its own concrete class, not one received across a boundary.
    Returns ids of the Attribute nodes on such names."""
    own: set[int] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        built = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                callee = ast.unparse(node.value.func).split(".")[0]
                if callee[:1].isupper():
                    built |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in built:
                    own.add(id(node))
    return own


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _walk(paths: Iterable[Path]) -> Iterator[tuple[Path, ast.AST]]:
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            yield path, node


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:90]}"


def undeclared_members(paths: Iterable[Path], declared: set[str]) -> list[str]:
    hits = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        own = _built_here(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _holder(node.value) and id(node) not in own:
                if node.attr not in declared and not _is_dunder(node.attr):
                    hits.append(_where(path, node))
    return hits


def probes(paths: Iterable[Path], declared: set[str]) -> list[str]:
    hits = []
    for path, node in _walk(paths):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__getattr__":
                    where = f"{path.relative_to(ROOT)}:{item.lineno}"
                    hits.append(f"{where}: {node.name}.__getattr__ forwards anything")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("hasattr", "getattr") or len(node.args) < 2:
            continue
        target, name = node.args[0], node.args[1]
        member = name.value if isinstance(name, ast.Constant) else None
        if node.func.id == "getattr" and len(node.args) == 2 and not _holder(target):
            continue  # a plain dynamic read (``getattr(cfg, field)``), no default to fall to
        if _holder(target) or (member in declared and member not in COMMON_NAMES):
            hits.append(_where(path, node))
    return hits


def private_reaches(paths: Iterable[Path]) -> list[str]:
    hits = []
    for path, node in _walk(paths):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if _is_dunder(node.attr) or node.attr in THIRD_PARTY_PRIVATE:
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
            continue
        hits.append(_where(path, node))
    for path, node in _walk(paths):
        if isinstance(node, ast.ImportFrom) and node.module and _own(node.module, node.level):
            for alias in node.names:
                if alias.name.startswith("_") and not _is_dunder(alias.name):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
    return hits


def _own(module: str, level: int = 0) -> bool:
    return level > 0 or module == "mmyatt" or module.startswith("mmyatt.")


def function_level_imports(paths: Iterable[Path]) -> list[str]:
    """Imports of the project's own modules inside a function or method."""
    hits = []
    for path in paths:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and _own(node.module or "", node.level):
                    hits.append(_where(path, node))
                elif isinstance(node, ast.Import) and any(_own(a.name) for a in node.names):
                    hits.append(_where(path, node))
    return sorted(set(hits))


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """module -> project modules it imports (at any level: a function-level import is an
    edge too), resolved to the files that exist."""
    modules = {module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                    break
    return graph


def import_cycles(paths: list[Path]) -> list[list[str]]:
    """Strongly connected groups of two or more files (Tarjan), each sorted."""
    graph = import_graph(paths)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str]) -> None:
    """``[--protocols FILE] [paths...]``: FILE's protocols as the declared members (to
    count an older tree against today's protocols); paths: where to count
    function-level imports (every library file by default)."""
    protocols = ROOT / "mmyatt" / "protocols.py"
    if argv[:1] == ["--protocols"]:
        protocols, argv = Path(argv[1]), argv[2:]
    everything = library_files()
    engine = library_files(["mmyatt"])
    chosen = [ROOT / a for a in argv] if argv else everything
    chosen = [p for a in chosen for p in ([a] if a.is_file() else sorted(a.rglob("*.py")))]
    declared = declared_members(protocols)
    counts = {
        "undeclared members (mmyatt/)": undeclared_members(engine, declared),
        "probes (library)": probes(everything, declared),
        "private reaches (mmyatt/)": private_reaches(engine),
        "function-level imports (chosen files)": function_level_imports(chosen),
        "file import cycles (library)": [" <-> ".join(c) for c in import_cycles(everything)],
    }
    for title, hits in counts.items():
        print(f"{title}: {len(hits)}")
        for hit in hits:
            print(f"    {hit}")


if __name__ == "__main__":
    main(sys.argv[1:])
