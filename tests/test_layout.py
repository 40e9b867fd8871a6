"""The layout of lib/ by role, read from the code itself: three layers whose imports point one way (papers -> core
-> infra), no paper importing another, no import circle, and no lib import hidden inside a function."""
import ast
from pathlib import Path

import pytest

from lib.infra import paths

LIB = paths.ROOT / "lib"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(paths.ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(LIB.rglob("*.py"))}


def lib_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported lib module, inside a function?) for every import of a lib module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lib":
            for alias in node.names:  # `from lib import hooks` imports the module lib.hooks; `from lib.x import f`, lib.x
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in MODULES else node.module, id(node) in inside))
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in inside) for a in node.names if a.name.split(".")[0] == "lib"]
    return out


def layer(module: str) -> str:
    if module.startswith("lib.infra"):
        return "infra"
    if module.startswith("lib.papers."):
        return "paper"
    if module in ("lib.nb", "lib.__main__", "lib.papers") or module.startswith("lib.exercises"):
        return "top"  # what a notebook starts and checks with: it may use anything
    return "core"


def test_the_modules_are_where_the_layout_says():
    assert {"lib.models", "lib.hooks", "lib.metrics", "lib.stats", "lib.verdict", "lib.data", "lib.plotting"} <= set(MODULES)
    assert {"lib.papers.dpo", "lib.papers.saobp", "lib.papers.relations", "lib.infra.index"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_lib_import_inside_a_function(module):
    hidden = sorted({m for m, inside in lib_imports(MODULES[module]) if inside})
    assert not hidden, f"{module} imports {hidden} inside a function"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module):
    """infra imports only infra; the core imports the core and infra; a paper imports the core, infra and itself."""
    mine = layer(module)
    for target, _ in lib_imports(MODULES[module]):
        theirs = layer(target)
        if mine == "infra":
            assert theirs == "infra", f"{module} (infrastructure) imports {target}"
        elif mine == "core":
            assert theirs in ("core", "infra"), f"{module} (core) imports {target}"
        elif mine == "paper":
            own = ".".join(module.split(".")[:3])
            assert theirs in ("core", "infra") or target.startswith(own), f"{module} imports another paper: {target}"


def test_no_import_circle():
    graph = {m: {t for t, _ in lib_imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # a package's __init__ that re-exports its modules is not a circle with them
    for m in graph:
        graph[m] = {t for t in graph[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_layout_test_sees_a_planted_violation(tmp_path):
    """The checks above can fail: a function-level import and an import of another paper are both found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from lib.papers import relations\n\ndef f():\n    from lib import hooks\n    return hooks\n")
    found = lib_imports(bad)
    assert ("lib.papers.relations", False) in found and ("lib.hooks", True) in found
    assert layer("lib.papers.dpo.probe") == "paper" and layer("lib.infra.store") == "infra"


def test_no_module_hard_codes_the_notebooks_order():
    """Which notebook needs which, and how long each runs, is the index's (config/notebooks.yaml): no lib code holds
    a notebook number as a string constant (docstrings aside)."""
    import re

    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{module}:{n.lineno} {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and re.fullmatch(r"\d\d", n.value) and id(n) not in docs]
    assert not found, found


def test_no_module_global_decides_where_outputs_go():
    """Figures and ledger records go where the notebook's run says (plotting.save(fig, run, ...),
    results.record(run, ...)); measurement records to the measured model's own folder (Loaded.records_name).
    No module keeps a current run."""
    from lib.infra import params, store

    assert not hasattr(params, "current") and not hasattr(params, "_CURRENT") and not hasattr(store, "owner")
