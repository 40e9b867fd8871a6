"""make student (lib.infra.runner.student_copies): solutions removed, outputs cleared, checks kept; a student
copy runs up to its first exercise, and its first check fails until the student answers."""
import json

import pytest

import nbformat
from nbclient import NotebookClient

from lib.infra import paths, runner

TOUR = paths.NOTEBOOKS / "00_tour.ipynb"


def tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def test_student_copies_drop_solutions_and_outputs_and_keep_checks(tmp_path):
    (copy,) = runner.student_copies([TOUR], tmp_path)
    full, student = json.loads(TOUR.read_text()), json.loads(copy.read_text())
    solutions = [c for c in full["cells"] if runner.SOLUTION_TAG in tags(c)]
    checks = [c for c in full["cells"] if "check" in tags(c)]
    assert solutions and checks
    assert len(student["cells"]) == len(full["cells"]) - len(solutions)
    assert not any(runner.SOLUTION_TAG in tags(c) for c in student["cells"])
    assert [c["source"] for c in student["cells"] if "check" in tags(c)] == [c["source"] for c in checks]
    assert all(not c["outputs"] and c["execution_count"] is None for c in student["cells"] if c["cell_type"] == "code")


def test_a_student_copy_runs_to_its_first_exercise_and_its_check_waits_for_an_answer(tmp_path):
    (copy,) = runner.student_copies([TOUR], tmp_path)
    nb = nbformat.read(copy, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "### Exercise" in c.source)
    first_check = next(c for c in nb.cells[first:] if "check" in tags(c))
    nb.cells = nb.cells[:first + 1] + [first_check]
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(paths.NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0] in nb.cells[-1].outputs, [e.get("ename") for e in errors]
    assert errors[0].ename == "NameError"  # the check reads the student's answer, which is not there yet


def _code(cell) -> str:
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    return "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))


def _stored_and_loaded(code: str) -> tuple[set, set]:
    import ast

    tree = ast.parse(code)
    stored, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, (ast.Store, ast.Del)) else loaded).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                stored |= {x.arg for x in a.args + a.kwonlyargs + a.posonlyargs} | {x.arg for x in (a.vararg, a.kwarg) if x}
        elif isinstance(node, ast.Lambda):
            stored |= {x.arg for x in node.args.args}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            stored.add(node.name)
    return stored, loaded


NOTEBOOKS = sorted(paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_cells_after_an_exercise_read_only_what_it_asks_for(nb):
    """Every cell outside the solutions, checks included, reads only names the notebook defines outside its
    solutions, names an exercise asks the student to define (in backticks), or names it defines itself: a
    correct answer never fails a check, or a later cell, with a NameError for a helper variable that only the
    worked solution happened to use."""
    import builtins
    import re

    cells = json.loads(nb.read_text())["cells"]
    defined, asked, problems = set(dir(builtins)) | {"display", "get_ipython"}, set(), []
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown":
            text = "".join(c["source"])
            if "### Exercise" in text:
                defined |= asked  # the previous exercise's answers exist from here on
                asked = set()
            asked |= {m.group(1) for m in re.finditer(r"`([A-Za-z_][A-Za-z0-9_]*)", text)}
            continue
        if c["cell_type"] != "code" or runner.SOLUTION_TAG in tags(c):
            continue
        stored, loaded = _stored_and_loaded(_code(c))
        free = sorted(loaded - stored - defined - asked)
        if free:
            problems.append(f"cell {i}{' (check)' if 'check' in tags(c) else ''}: {', '.join(free)}")
        defined |= stored
    assert not problems, f"{nb.name}: cells read names no exercise asks for: {'; '.join(problems)}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_a_student_copy_with_its_solutions_pasted_in_is_the_tested_notebook(nb, tmp_path):
    """Pasting each solution back where it was removed gives the notebook that nbval executes, cell for cell:
    so every student copy passes its checks with the solutions pasted in exactly when make test passes."""
    (copy,) = runner.student_copies([nb], tmp_path)
    full, student = json.loads(nb.read_text())["cells"], json.loads(copy.read_text())["cells"]
    pasted = iter(student)
    rebuilt = [c if runner.SOLUTION_TAG in tags(c) else next(pasted) for c in full]
    assert next(pasted, None) is None
    key = lambda c: (c["cell_type"], "".join(c["source"]), tags(c))  # noqa: E731
    assert [key(c) for c in rebuilt] == [key(c) for c in full]
    assert any(runner.SOLUTION_TAG in tags(c) for c in full) == any("check" in tags(c) for c in full)
