"""Build the static site of the executed notebooks (``make site``): Jupyter Book 1 (Sphinx), offline.

Writes a build source under ``docs/site/_build/src`` from what the repository holds, then runs
``jupyter-book build`` on it (HTML in ``docs/site/_build/_build/html``):

* ``index.md``: the findings table of README.md (``lib.infra.results.findings_table``, from
  ``results/<model>/claims.json``), then the contents in reading order with each notebook's run time
  (the index config/notebooks.yaml, ``test_s``, measured);
* ``course.md`` (this folder) and the glossary (``docs/glossary.md``);
* ``claims.md``: one overview figure (a forest plot of every finding, :func:`forest`) and the ledgers;
* the numbered notebooks as they are committed (never executed here), with stderr outputs dropped and
  the input of input-validation and assertion cells and of the Colab set-up cell hidden behind a
  toggle (tag ``hide-input``);
* MathJax from a local copy (``--mathjax``: the ``es5`` folder of the npm package ``mathjax``), so
  that math renders with no network.

Run with the compendium's Python (it needs matplotlib and lib); ``--jupyter-book`` names the
executable of the site's own environment (``docs/site/requirements.txt``).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from lib.infra import colab, index, paths, results

PARTS = [("Start here", ("00",)), ("Paper A: how DPO reduces toxicity", ("01", "02", "03", "04", "05", "06")),
         ("Paper B: attention localisation and SAOBP", ("07", "08", "09", "10")),
         ("Paper C: relation-specific neurons", ("11", "12", "13", "14"))]
VERDICT_COLOURS = {"holds": "#1b7837", "partly holds": "#7fbf7b", "inconclusive": "#999999",
                   "does not hold": "#c51b7d"}
# cells whose code only checks the parameters or asserts what must hold: their input is folded away
VALIDATION = re.compile(r"params\.check\(")


def _is_validation(source: str) -> bool:
    code = [ln for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return bool(code) and (bool(VALIDATION.search(source)) or all(ln.lstrip().startswith("assert") for ln in code))


def prepare_notebook(src: Path, dst: Path) -> dict:
    """Copy one executed notebook for the site: stderr streams dropped, validation inputs folded.
    Returns counts of what changed."""
    nb = nbformat.read(src, as_version=4)
    dropped = folded = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = [o for o in cell.get("outputs", []) if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        dropped += len(cell.get("outputs", [])) - len(kept)
        cell["outputs"] = kept
        if _is_validation(cell.source) or colab.TAG in cell.metadata.get("tags", []):
            tags = cell.metadata.setdefault("tags", [])
            if "hide-input" not in tags:
                tags.append("hide-input")
                folded += 1
    nbformat.write(nb, dst)
    return {"stderr dropped": dropped, "inputs folded": folded}


def _title(nb_path: Path) -> str:
    nb = nbformat.read(nb_path, as_version=4)
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), nb_path.stem)
    return first.splitlines()[0].lstrip("# ").strip()


def ledger_rows() -> list[dict]:
    """Every published ledger row, with its model (results/<model>/claims.json, models sorted)."""
    rows = []
    for f in sorted(paths.RESULTS.glob("*/claims.json")):
        doc = json.loads(f.read_text())
        rows += [{**r, "model": doc["model"]} for r in doc["rows"]]
    return sorted(rows, key=lambda r: r["notebook"])  # reading order; a notebook's rows keep their order


_md = results._cell  # one escaping rule for every table cell (pipes escaped, newlines flattened)


def contents(notebooks: list[Path], models: list[str] | None = None) -> str:
    """The start page: the findings table of README.md (:func:`lib.infra.results.findings_table`, from the published
    ledgers; ``models``: its columns), then each part's notebooks with their run times."""
    lines = ["# A compendium of three EMNLP 2025 interpretability papers", "",
             "Each notebook re-runs one finding of one paper on small models and decides it by one evidence rule "
             "(`lib.verdict`): a criterion stated before any result, preconditions, an interval, and matched controls. "
             "The verdicts below are the notebooks' own, at their default parameters; the [claims page](claims.md) "
             "draws them all in one figure. The [course outline](course.md) orders them into sessions, and the "
             "[glossary](glossary.md) explains the abbreviations.", "",
             "## Findings at a glance", "",
             "One row per finding, one column per model (verdict: estimate [95% CI]), from `results/<model>/claims.json`.",
             "", results.findings_table(models).rstrip("\n"), "",
             "Run time: seconds for the notebook's test (nbval) from an empty cache on one CPU thread beside another "
             "job (`test_s` in config/notebooks.yaml); later notebooks reuse what earlier ones cached.", ""]
    for part, numbers in PARTS:
        here = [p for p in notebooks if p.name[:2] in numbers]
        if not here:
            continue
        lines += [f"## {part}", "", "| notebook | run time (s) |", "|---|---|"]
        for p in here:
            secs = index.test_seconds().get(p.name[:2])
            lines.append(f"| [{_md(_title(p))}](notebooks/{p.stem}.ipynb) | {secs if secs is not None else ''} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def forest(rows: list[dict], out: Path) -> tuple[int, int]:
    """A forest plot of every ledger row with numbers: its estimate and interval, its control band's
    edge and the paper's effect, each divided by the finding's threshold (so 0 is no effect and 1 the
    threshold: the smallest effect that counts, or a bound finding's bound; a 'less' finding is
    mirrored so that the claimed side is on the right).
    Saves <out>.png and <out>.svg; returns (rows drawn, rows without an estimate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [r for r in rows if isinstance(r.get("plot"), dict) and r["plot"].get("value") is not None
             and r["plot"].get("threshold")]
    fig, ax = plt.subplots(figsize=(10, 0.42 * max(len(drawn), 1) + 1.6), layout="constrained")
    for y, r in enumerate(reversed(drawn)):
        p = r["plot"]
        s = (-1 if p.get("direction") == "less" else 1) / abs(p["threshold"])
        v, lo, hi = (x * s for x in (p["value"], p["low"], p["high"]))
        lo, hi = min(lo, hi), max(lo, hi)
        colour = VERDICT_COLOURS.get(r["verdict"], "black")
        if p.get("control_edge") is not None:
            edge = p["control_edge"] * s
            ax.plot([min(0, edge), max(0, edge)], [y, y], color="#bbbbbb", lw=9, solid_capstyle="butt", zorder=1)
        ax.plot([lo, hi], [y, y], color=colour, lw=2, zorder=2)
        ax.plot([v], [y], "o", color=colour, zorder=3)
        if p.get("paper_effect") is not None:
            ax.plot([p["paper_effect"] * s], [y], "D", mfc="none", mec="black", zorder=4)
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(1, color="black", lw=0.8, ls="--")
    models = {r["model"] for r in rows}

    def label(r):
        # 07 measures several models in one run: its rows name theirs, so the run's model is left off
        named = any(m in r["finding"] for m in models) or "from-scratch" in r["finding"]
        text = f"{r['notebook'][:2]} {r['finding']}" + ("" if named else f" ({r['model']})")
        return "\n".join(textwrap.wrap(text, 60, max_lines=2, placeholder="..."))

    labels = [label(r) for r in reversed(drawn)]
    ax.set_yticks(range(len(drawn)), labels, fontsize=7.5)
    ax.set_xscale("symlog", linthresh=1)
    ax.margins(x=0.04)
    ax.set_xlabel("estimate / the finding's threshold\n(0: no effect; 1, dashed: the threshold; symmetric log beyond 1)")
    handles = [plt.Line2D([], [], color=c, marker="o", lw=2, label=v) for v, c in VERDICT_COLOURS.items()]
    handles += [plt.Line2D([], [], color="#bbbbbb", lw=9, label="control band (0 to the controls' 95th pct.)"),
                plt.Line2D([], [], marker="D", mfc="none", mec="black", lw=0, label="paper's effect")]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    ax.set_title("Every finding with an estimate:\n95% interval, control band and the paper's effect", fontsize=10)
    for ext in ("png", "svg"):
        fig.savefig(out.with_suffix(f".{ext}"), dpi=120)
    plt.close(fig)
    return len(drawn), len(rows) - len(drawn)


def claims_page(rows: list[dict], n_drawn: int, n_missing: int) -> str:
    lines = ["# Claims ledger", "",
             "Every finding of every notebook at its default parameters, from `results/<model>/claims.json`.", "",
             "```{figure} forest.svg", ":name: forest", ":width: 100%", "",
             f"{n_drawn} findings with an estimate, each divided by its finding's threshold (mirrored where the paper's effect is a fall, so the claimed side is on the right); grey: the band of its "
             "matched random controls (up to their 95th percentile, where the notebook ran controls); diamonds: the "
             "paper's effect where it gives one in our units. Colour: the verdict."
             + (f" {n_missing} findings have no estimate or no numbers in the ledger and are not drawn." if n_missing else ""),
             "```", "",
             "The reasons, controls and preconditions of each row are in `results/<model>/claims.md`.", "",
             "| notebook | model | finding | verdict | estimate [95% CI] |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(_md(r[k]) for k in ("notebook", "model", "finding"))
                     + f" | **{_md(r['verdict'])}** | {_md(r['estimate'])} |")
    return "\n".join(lines) + "\n"


def toc(notebooks: list[Path]) -> str:
    lines = ["format: jb-book", "root: index", "parts:", "  - caption: Using the compendium", "    chapters:",
             "      - file: course", "      - file: claims", "      - file: glossary"]
    for part, numbers in PARTS:
        here = [p for p in notebooks if p.name[:2] in numbers]
        if here:
            lines += [f"  - caption: \"{part}\"", "    chapters:"] + [f"      - file: notebooks/{p.stem}" for p in here]
    return "\n".join(lines) + "\n"


def prepare(src: Path, mathjax: Path) -> dict:
    """Write the build source; returns what it holds."""
    if not (mathjax / "tex-chtml.js").exists():
        raise FileNotFoundError(f"no MathJax at {mathjax}: give --mathjax the es5 folder of the npm package 'mathjax'")
    if src.exists():
        shutil.rmtree(src)
    (src / "notebooks").mkdir(parents=True)
    shutil.copy(HERE / "_config.yml", src / "_config.yml")
    shutil.copy(HERE / "course.md", src / "course.md")
    shutil.copy(ROOT / "docs" / "glossary.md", src / "glossary.md")
    shutil.copytree(mathjax, src / "_static" / "mathjax")
    notebooks = index.numbered_notebooks()
    changes = {p.stem: prepare_notebook(p, src / "notebooks" / p.name) for p in notebooks}
    rows = ledger_rows()
    (src / "index.md").write_text(contents(notebooks))
    n_drawn, n_missing = forest(rows, src / "forest")
    if rows and not n_drawn:
        print("warning: no ledger row has the numbers the forest plot needs (a 'plot' entry, lib.verdict.Verdict.plot); "
              "re-run the notebooks and `python -m lib claims` to record them", file=sys.stderr)
    (src / "claims.md").write_text(claims_page(rows, n_drawn, n_missing))
    (src / "_toc.yml").write_text(toc(notebooks))
    return {"notebooks": len(notebooks), "rows": len(rows), "drawn": n_drawn, "changes": changes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mathjax", type=Path, required=True, help="the es5 folder of the npm package mathjax")
    ap.add_argument("--jupyter-book", default="jupyter-book", help="the jupyter-book executable (site environment)")
    ap.add_argument("--out", type=Path, default=HERE / "_build")
    args = ap.parse_args(argv)
    src = args.out / "src"
    info = prepare(src, args.mathjax)
    print(f"site source: {info['notebooks']} notebooks, {info['rows']} ledger rows ({info['drawn']} in the forest plot)")
    subprocess.run([args.jupyter_book, "build", str(src), "--path-output", str(args.out), "--builder", "html"],
                   check=True)
    html = args.out / "_build" / "html"
    pages = sorted(html.rglob("*.html"))
    print(f"site: {html} ({len(pages)} pages)")


if __name__ == "__main__":
    main()
