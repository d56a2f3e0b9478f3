"""The packages' import graph: qlib is the base every package may import and which imports none of
them; qvisor (the runtime) sits on top of qkernel and tsor, which never reach back into it; qkernel
and tsor run without each other (what both must agree on lives in qlib); and no two packages
import each other, however indirectly.

Every import counts, at module level or inside a function (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qlib", "qvisor", "qkernel", "tsor", "shim", "cni")


def _module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(path: Path) -> set[str]:
    """The absolute names of every module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
    return out


def edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the files that make the edge."""
    found: dict[tuple[str, str], list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in _imported(path):
                target = name.split(".")[0]
                where = str(path.relative_to(ROOT))
                if target in PACKAGES and target != pkg and where not in found.get((pkg, target), []):
                    found.setdefault((pkg, target), []).append(where)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:   # back to a package on the current path: a cycle
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_every_package_is_seen() -> None:
    # guards the walk itself: these edges exist by design, so a parser that saw nothing would fail here
    found = edges()
    assert ("qvisor", "qlib") in found and ("qvisor", "qkernel") in found and ("shim", "qvisor") in found


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst in edges():
        graph.setdefault(src, set()).add(dst)
    cycle = _cycle(graph)
    assert cycle is None, f"packages import each other: {' -> '.join(cycle or [])} ({edges()})"


def test_layering() -> None:
    forbidden = [("qlib", other) for other in PACKAGES if other != "qlib"]
    forbidden += [(pkg, "qvisor") for pkg in ("qkernel", "tsor", "qlib")] + [("tsor", "qkernel"), ("qkernel", "tsor")]
    found = edges()
    broken = {edge: found[edge] for edge in forbidden if edge in found}
    assert not broken, f"imports against the layering (importer, imported): files: {broken}"


def _modules() -> dict[str, Path]:
    return {".".join(_module_of(path)): path for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))}


def _module_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `path` imports, at any level, but not under `if TYPE_CHECKING:` (type
    names only, never executed); `from pkg import mod` counts as importing pkg.mod."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module[:-1]
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    out = set()
    for name in names:   # the longest prefix that is one of ours (a function or class of it: the module)
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                out.add(".".join(parts[:i]))
                break
    return out - {".".join(module)}


def test_no_cycle_between_modules() -> None:
    """No module reaches itself through what it imports (the sandbox factory, the CLI and the
    container operations once did), so each can be read and changed from the bottom up."""
    known = _modules()
    assert {"qvisor.factory.server", "qvisor.cli", "qvisor.container.create", "qvisor.birth"} <= set(known)
    graph = {name: _module_imports(path, known) for name, path in known.items()}
    assert "qvisor.factory.client" in graph["qvisor.cli"]   # the walk sees function-level imports
    cycle = _cycle(graph)
    assert cycle is None, f"modules import each other: {' -> '.join(cycle or [])}"


def test_no_private_name_is_used_across_modules() -> None:
    """A name with a leading underscore belongs to its module: no other module imports it or
    reaches it through the module (`from x import _y`, `x._y`), so a module's private parts can
    change without a search through the others."""
    known = _modules()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        module = _module_of(path)
        package = module if path.name == "__init__.py" else module[:-1]
        aliases = set()   # names in this file bound to one of the project's modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else [])) \
                    if node.level else node.module or ""
                if base.split(".")[0] not in PACKAGES:
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}: from {base} import {a.name}")
                    if f"{base}.{a.name}" in known:
                        aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] in PACKAGES)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "private names used outside their module:\n" + "\n".join(found)
