"""Execute the numbered notebooks with papermill and gather their claims.

    python -m lib.runner run notebooks/01_toxicity_probe.ipynb --model smollm2-135m
    python -m lib.runner all --model smollm2-135m
    python -m lib.runner claims --model smollm2-135m
    python -m lib.runner merge            # results/claims.md: every model's verdicts side by side

Executed copies go to results/<model>/<notebook>.ipynb, wall time and peak memory to
results/<model>/timings/<notebook>.json, figures to figures/<model>/ (written by the notebooks).
Per-model settings come from params/<model>.yaml when it exists (papermill's -f); a ``device_map``
key there (or ``--device-map``) also reaches ``lib.models.load`` through COMPENDIUM_DEVICE_MAP, so
models larger than one GPU are spread over the GPUs without a notebook parameter.
With ``--atomic`` (the Snakefile uses it) the executed notebook is written under a temporary name and
renamed on success; a failed run leaves <notebook>.failed.ipynb instead, never a complete-looking output.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
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


def parameter_defaults(notebook: Path) -> dict:
    """The literal defaults of the notebook's ``parameters`` cell, read with ``ast`` (no papermill
    import: the Snakefile calls this for every notebook when it builds the DAG)."""
    import ast

    doc = json.loads(Path(notebook).read_text(encoding="utf-8"))
    for cell in doc.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            out = {}
            for node in ast.parse(src).body:
                target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                    getattr(node, "target", None) if isinstance(node, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and node.value is not None:
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass  # not a literal: papermill would not override it either
            return out
    return {}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def params_settings(model_name: str) -> dict:
    """The parameters in params/<model>.yaml ({} when there is none)."""
    import yaml

    pf = params_file(model_name)
    return (yaml.safe_load(pf.read_text()) or {}) if pf else {}


def run(notebook: Path, model_name: str | None = None, extra: dict | None = None, device: str | None = None,
        atomic: bool = False, device_map: str | None = None) -> dict:
    """Execute one notebook in a child process (its default model unless ``model_name``);
    return its timing record.

    atomic: write to a temporary name and rename on success (failure: <notebook>.failed.ipynb).
    device_map: exported as COMPENDIUM_DEVICE_MAP (default: params/<model>.yaml's ``device_map``).
    """
    notebook = Path(notebook).resolve()
    if not notebook.exists():
        raise FileNotFoundError(f"no notebook {notebook}")
    model_name = model_name or default_model(notebook)
    out_dir = paths.results_dir(model_name)
    out = out_dir / notebook.name
    final = out
    if atomic:
        out = out_dir / f".{notebook.stem}.partial.ipynb"
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(out), "--cwd", str(paths.NOTEBOOKS),
           "-p", "model_name", model_name, "--log-level", "WARNING", "--no-progress-bar"]
    if device:
        cmd += ["-p", "device", device]
    pf = params_file(model_name)
    if pf:
        cmd += ["-f", str(pf)]
    for k, v in (extra or {}).items():
        cmd += ["-p", k, str(v)]
    env = None
    device_map = device_map or params_settings(model_name).get("device_map")
    if device_map:
        env = {**os.environ, "COMPENDIUM_DEVICE_MAP": str(device_map)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    try:
        if atomic and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_interrupt)  # a cancelled job stops its child too
        _, status, usage = os.wait4(proc.pid, 0)  # rusage covers papermill and its kernel
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if atomic:
            out.unlink(missing_ok=True)  # nothing half-written is left behind
        raise
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    rec = {"notebook": notebook.stem, "model": model_name, "seconds": round(wall, 1),
           "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "exit_code": rc,
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_text(out_dir / "timings" / f"{notebook.stem}.json", json.dumps(rec, indent=2) + "\n")
    if atomic:
        if rc == 0:
            os.replace(out, final)
        else:
            final.unlink(missing_ok=True)  # no complete-looking output from a failed run
            if out.exists():  # papermill saves the notebook up to the failing cell: keep it to read
                failed = out_dir / f"{notebook.stem}.failed.ipynb"
                os.replace(out, failed)
                out = failed
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
    r.add_argument("--atomic", action="store_true",
                   help="write under a temporary name, rename on success (failure: <nb>.failed.ipynb)")
    r.add_argument("--device-map", default=None, help="e.g. auto: spread the model over the GPUs")
    c = sub.add_parser("claims", help="write results/<model>/claims.md")
    c.add_argument("--model", default="smollm2-135m")
    m = sub.add_parser("merge", help="write results/claims.md: findings x models")
    m.add_argument("--models", nargs="*", default=None, help="columns, in order (default: every model with records)")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        print(json.dumps(run(Path(args.notebook), args.model, device=args.device, atomic=args.atomic,
                             device_map=args.device_map)))
    elif args.cmd == "merge":
        from lib.results import merge_claims

        print(merge_claims(args.models or None))
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
