"""Execute the numbered notebooks with papermill and gather their claims.

    python -m lib.runner run notebooks/01_toxicity_probe.ipynb --model smollm2-135m
    python -m lib.runner all --model smollm2-135m
    python -m lib.runner claims --model smollm2-135m

Executed copies go to results/<model>/<notebook>.ipynb, wall time and peak memory to
results/<model>/timings/<notebook>.json, figures to figures/<model>/ (written by the notebooks).
Per-model settings come from params/<model>.yaml when it exists (papermill's -f).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from lib import paths
from lib.cache import atomic_write_text

NUMBERED = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")


def numbered_notebooks() -> list[Path]:
    return sorted(p for p in paths.NOTEBOOKS.glob("*.ipynb") if NUMBERED.match(p.name))


def params_file(model_name: str) -> Path | None:
    p = paths.PARAMS / f"{paths.slug(model_name)}.yaml"
    return p if p.exists() else None


def default_model(notebook: Path) -> str:
    """The notebook's own default ``model_name`` (its parameters cell), read without running it."""
    import papermill

    params = papermill.inspect_notebook(str(notebook))
    if "model_name" not in params:
        raise ValueError(f"{notebook.name} has no model_name parameter")
    return str(params["model_name"]["default"]).strip("\"'")


def run(notebook: Path, model_name: str | None = None, extra: dict | None = None, device: str | None = None) -> dict:
    """Execute one notebook in a child process (its default model unless ``model_name``);
    return its timing record."""
    notebook = Path(notebook).resolve()
    if not notebook.exists():
        raise FileNotFoundError(f"no notebook {notebook}")
    model_name = model_name or default_model(notebook)
    out_dir = paths.results_dir(model_name)
    out = out_dir / notebook.name
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(out), "--cwd", str(paths.NOTEBOOKS),
           "-p", "model_name", model_name, "--log-level", "WARNING", "--no-progress-bar"]
    if device:
        cmd += ["-p", "device", device]
    pf = params_file(model_name)
    if pf:
        cmd += ["-f", str(pf)]
    for k, v in (extra or {}).items():
        cmd += ["-p", k, str(v)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)  # rusage covers papermill and its kernel
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    rec = {"notebook": notebook.stem, "model": model_name, "seconds": round(wall, 1),
           "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "exit_code": rc,
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_text(out_dir / "timings" / f"{notebook.stem}.json", json.dumps(rec, indent=2) + "\n")
    if rc != 0:
        raise SystemExit(f"{notebook.name} failed for {model_name} (exit {rc}); see {out}")
    return rec


def claims(model_name: str) -> Path:
    from lib.results import write_claims

    return write_claims(model_name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute one notebook")
    r.add_argument("notebook")
    a = sub.add_parser("all", help="execute every numbered notebook in order")
    for p in (r, a):
        p.add_argument("--model", default=None, help="default: each notebook's own model_name")
        p.add_argument("--device", default=None)
    c = sub.add_parser("claims", help="write results/<model>/claims.md")
    c.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        print(json.dumps(run(Path(args.notebook), args.model, device=args.device)))
    elif args.cmd == "all":
        seen = []
        for nb in numbered_notebooks():
            rec = run(nb, args.model, device=args.device)
            print(json.dumps(rec), flush=True)
            seen.append(rec["model"])
        for m in sorted(set(seen)):
            print(claims(m))
    else:
        print(claims(args.model))


if __name__ == "__main__":
    main()
