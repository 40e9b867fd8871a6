"""Execute the numbered notebooks with papermill and gather their claims.

    python -m lib run notebooks/01_toxicity_probe.ipynb --model smollm2-135m
    python -m lib all --model smollm2-135m
    python -m lib claims --model smollm2-135m
    python -m lib merge            # results/claims.md: every model's verdicts side by side
    python -m lib readme           # README.md's findings table, from the committed ledgers
    python -m lib recover          # after a killed run: stale Snakemake lock, leftover .partial files
    python -m lib stability --notebooks 00   # key-number cells at 1 and 2 threads (make test-stability)
    python -m lib test             # make test: pytest on lib/ + nbval per notebook from the records, the audit
    python -m lib audit            # make audit: a seeded sample of the records measured again and compared
    python -m lib kernel-config    # quiet the kernel's "TCP without encryption" warning (make setup)
    python -m lib student          # make student: student copies in students/ (solutions removed)
    python -m lib student --run    # make test-student: each copy runs up to its first check

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
import configparser
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lib.infra import index, paths, repro, results, store
from lib.infra.cache import atomic_write_text


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(notebook: Path, model_name: str | None = None, extra: dict | None = None, device: str | None = None,
        atomic: bool = False, device_map: str | None = None, publish: bool = True) -> dict:
    """Execute one notebook in a child process (its default model unless ``model_name``);
    return its timing record.

    publish: the run writes the published figures and ledger records (``lib.infra.paths.PUBLISH_ENV``) when its
    parameters are the published ones; False: to its run folder, like any run by hand.

    atomic: write to a temporary name and rename on success (failure: <notebook>.failed.ipynb).
    device_map: exported as COMPENDIUM_DEVICE_MAP (default: params/<model>.yaml's ``device_map``).
    """
    notebook = Path(notebook).resolve()
    if not notebook.exists():
        raise FileNotFoundError(f"no notebook {notebook}")
    model_name = model_name or index.default_model(notebook)
    out_dir = paths.results_dir(model_name)
    out = out_dir / notebook.name
    final = out
    if atomic:
        out = out_dir / f".{notebook.stem}.partial.ipynb"
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(out), "--cwd", str(paths.NOTEBOOKS),
           "-p", "model_name", model_name, "--log-level", "WARNING", "--no-progress-bar"]
    if device:
        cmd += ["-p", "device", device]
    pf = index.params_file(model_name)
    if pf:
        cmd += ["-f", str(pf)]
    for k, v in (extra or {}).items():
        cmd += ["-p", k, str(v)]
    env = {**os.environ, **repro.quiet_env()}  # stored outputs carry no progress bars
    env.pop(paths.PUBLISH_ENV, None)
    if publish:
        env[paths.PUBLISH_ENV] = "1"
    device_map = device_map or index.params_settings(model_name).get("device_map")
    if device_map:
        env["COMPENDIUM_DEVICE_MAP"] = str(device_map)
    install_kernel_config(quiet=True)
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


# ----------------------------------------------------------------------------- the kernel's TCP warning

# ipykernel >= 7 logs "Kernel is running over TCP without encryption ..." at start-up whenever the
# kernel manager chose TCP, which papermill (through nbclient) and nbval always do: both create their
# jupyter_client.KernelManager without a traitlets config, so its `transport` cannot be set to "ipc"
# from outside. Every IPython kernel reads <sys.prefix>/etc/ipython/ipython_kernel_config.py, so this
# file, installed into the compendium's venv, drops that one log record (nothing else) for every
# kernel the venv starts: papermill runs, lib.infra.runner, nbval. The kernel listens on 127.0.0.1 only.
KERNEL_CONFIG_TEXT = """\
# Written by `python -m lib kernel-config` (make setup): the compendium's kernels run on this
# machine only (127.0.0.1); drop ipykernel's start-up warning about unencrypted TCP, nothing else.
import logging


class _NoLocalTcpWarning(logging.Filter):
    def filter(self, record):
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(_NoLocalTcpWarning())
"""


def kernel_config_path() -> Path:
    return Path(sys.prefix) / "etc" / "ipython" / "ipython_kernel_config.py"


def install_kernel_config(quiet: bool = False) -> Path | None:
    """Write :data:`KERNEL_CONFIG_TEXT` to <sys.prefix>/etc/ipython/ipython_kernel_config.py when the
    interpreter is a virtual environment (never a system Python) and the file is missing or ours;
    a file someone else wrote is left alone. Returns the path when it holds our filter."""
    target = kernel_config_path()
    if sys.prefix == sys.base_prefix:
        if not quiet:
            print(f"not a virtual environment ({sys.prefix}): kernel config left alone")
        return None
    if target.exists():
        text = target.read_text(encoding="utf-8")
        if text == KERNEL_CONFIG_TEXT:
            return target
        # ours: written by this command, or by `python -m lib.runner kernel-config` before the command line moved
        if not text.startswith(("# Written by `python -m lib kernel-config`", "# Written by `python -m lib.runner kernel-config`")):
            if not quiet:
                print(f"{target} exists and is not ours: left alone")
            return None
    try:
        atomic_write_text(target, KERNEL_CONFIG_TEXT)
    except OSError as e:
        if not quiet:
            print(f"could not write {target}: {e}")
        return None
    return target


# ----------------------------------------------------------------------------- recovering a killed run


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _is_snakemake(argv: list[str]) -> bool:
    for i, a in enumerate(argv[:4]):  # the interpreter, maybe -m, then the program
        if Path(a).name == "snakemake" or a.endswith("snakemake/__main__.py"):
            return True
        if a == "-m" and argv[i + 1:i + 2] == ["snakemake"]:
            return True
    return False


def _is_runner_job(argv: list[str]) -> bool:
    return any(a == "lib.infra.runner" and argv[i + 1:i + 2] == ["run"] for i, a in enumerate(argv))


def workflow_processes(workdir: Path = paths.ROOT) -> list[tuple[int, str]]:
    """(pid, kind) of the processes that may hold this folder's Snakemake lock or write its
    .partial notebooks: Snakemake ('snakemake') and runner jobs ('runner') whose working directory
    is ``workdir``. A Snakemake process whose directory cannot be read (another user's) counts too."""
    workdir = Path(workdir).resolve()
    me = {os.getpid(), os.getppid()}
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in me:
            continue
        argv = _cmdline(int(d.name))
        kind = "snakemake" if _is_snakemake(argv) else "runner" if _is_runner_job(argv) else None
        if kind is None:
            continue
        try:
            cwd = Path(os.readlink(d / "cwd")).resolve()
        except OSError:
            if kind == "snakemake":
                found.append((int(d.name), kind))
            continue
        if cwd == workdir:
            found.append((int(d.name), kind))
    return found


def recover(workdir: Path = paths.ROOT, results: Path | None = None) -> list[str]:
    """Make the folder runnable again after a killed Snakemake (``kill -9``, a closed terminal, a
    lost node): when no Snakemake process and no runner job works in ``workdir``, remove the lock
    Snakemake left in <workdir>/.snakemake/locks (what `.venv/bin/snakemake --unlock` does with
    Snakemake's default file backend) and the hidden ``.<notebook>.partial.ipynb`` files that
    ``run(..., atomic=True)`` writes under ``results`` (default: <workdir>/results). With a live
    process nothing is touched. Returns one line per action (or why nothing was done)."""
    workdir = Path(workdir).resolve()
    results = Path(results) if results is not None else workdir / "results"
    locks = workdir / ".snakemake" / "locks"
    lock_files = sorted(locks.glob("*.lock")) if locks.is_dir() else []
    partial = sorted(results.rglob(".*.partial.ipynb")) if results.is_dir() else []
    if not lock_files and not partial:
        return []
    if not Path("/proc").is_dir():  # not Linux: no way to tell a live Snakemake from a killed one
        return [f"cannot tell whether Snakemake runs in {workdir} (no /proc): if none does, "
                "run `.venv/bin/snakemake --unlock` once"]
    live = workflow_processes(workdir)
    if live:
        who = ", ".join(f"{kind} pid {pid}" for pid, kind in live)
        return [f"a workflow process runs in {workdir} ({who}): its lock and partial notebooks are left alone"]
    out = []
    if lock_files:
        shutil.rmtree(locks, ignore_errors=True)
        out.append(f"removed the stale Snakemake lock in {locks} (no Snakemake process runs in {workdir}; "
                   "the same as `.venv/bin/snakemake --unlock`)")
    for f in partial:
        f.unlink(missing_ok=True)
        out.append(f"removed the leftover partial notebook {f} (from an interrupted run)")
    return out


# ----------------------------------------------------------------------------- stability across thread counts

KEY_MARK = "# NBVAL_CHECK_OUTPUT"
SANITIZE_CFG = paths.ROOT / "tests" / "nbval_sanitize.cfg"
# What the notebooks read; stability runs use a copy, so their figures and records stay out of the tree.
SANDBOX_PARTS = ("lib", "notebooks", "data", "params", "pyproject.toml")


def _source(cell) -> str:
    src = cell.get("source", "")
    return src if isinstance(src, str) else "".join(src)


def sanitizers(cfg: Path = SANITIZE_CFG) -> list[tuple[re.Pattern, str]]:
    """The (regex, replacement) pairs of nbval's sanitize file (times, addresses, progress bars)."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(cfg, encoding="utf-8")
    return [(re.compile(parser[s]["regex"]), parser[s]["replace"]) for s in parser.sections()]


def key_cell_outputs(notebook, sanitize: list[tuple[re.Pattern, str]] | None = None) -> list[str]:
    """What each key-number cell of an executed notebook printed: the code cells containing
    ``# NBVAL_CHECK_OUTPUT`` or tagged ``nbval-check-output``, in order; stream text, the plain-text
    form of results and displays, and errors, passed through nbval's sanitizers."""
    doc = notebook if isinstance(notebook, dict) else json.loads(Path(notebook).read_text(encoding="utf-8"))
    subs = sanitizers() if sanitize is None else sanitize
    out = []
    for cell in doc.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        if KEY_MARK not in _source(cell) and "nbval-check-output" not in cell.get("metadata", {}).get("tags", []):
            continue
        parts = []
        for o in cell.get("outputs", []):
            kind = o.get("output_type")
            if kind == "stream":
                t = o.get("text", "")
            elif kind in ("execute_result", "display_data"):
                t = o.get("data", {}).get("text/plain", "")
            elif kind == "error":
                t = f"{o.get('ename')}: {o.get('evalue')}\n"
            else:
                continue
            parts.append(t if isinstance(t, str) else "".join(t))
        text = "".join(parts)
        for rx, rep in subs:
            text = rx.sub(rep, text)
        out.append(text)
    return out


def compare_key_cells(a, b, label_a: str = "a", label_b: str = "b") -> str:
    """'' when the key-number cells of two executed notebooks (paths or parsed JSON) print the same
    after sanitizing, else a unified diff of what they print."""
    ka, kb = key_cell_outputs(a), key_cell_outputs(b)
    if ka == kb:
        return ""
    head = f"{len(ka)} key-number cell(s) in {label_a}, {len(kb)} in {label_b}\n" if len(ka) != len(kb) else ""
    lines = []
    for i in range(max(len(ka), len(kb))):
        ta = ka[i] if i < len(ka) else ""
        tb = kb[i] if i < len(kb) else ""
        if ta != tb:
            lines += difflib.unified_diff(ta.splitlines(keepends=True), tb.splitlines(keepends=True),
                                          f"{label_a} (key cell {i + 1})", f"{label_b} (key cell {i + 1})")
    return head + "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def select_notebooks(numbers: str | None) -> list[Path]:
    """The numbered notebooks, or those whose two-digit numbers are listed ('00,07'; '0' means '00')."""
    nbs = index.numbered_notebooks()
    if not numbers:
        return nbs
    want = [n.strip().zfill(2) for n in str(numbers).split(",") if n.strip()]
    by_number = {p.name[:2]: p for p in nbs}
    unknown = [n for n in want if n not in by_number]
    if unknown:
        raise SystemExit(f"no numbered notebook {', '.join(unknown)} (have {', '.join(sorted(by_number))})")
    return [by_number[n] for n in dict.fromkeys(want)]


def _sandbox(dest: Path) -> Path:
    """A copy of what the notebooks read (lib, notebooks, data, params) under ``dest``."""
    for part in SANDBOX_PARTS:
        src = paths.ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        elif src.exists():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
    return dest


def stability(notebooks: list[Path], threads: tuple[int, ...] = (1, 2), fresh_cache: bool = False,
              out_dir: Path | None = None, timeout: int | None = None) -> dict[str, str]:
    """Run each notebook with papermill at every COMPENDIUM_THREADS in ``threads`` (default
    parameters, as nbval runs them) and compare what its key-number cells print. Returns
    {notebook stem: problem}: '' when every run prints the same, else the diff or the failure.

    The runs use a copy of lib/, notebooks/, data/ and params/ (<out_dir>/tree; ``out_dir`` is a new
    temporary folder by default), so figures and records stay out of the working tree; the executed
    notebooks are <out_dir>/threads-<n>/<notebook>.ipynb. The cache (COMPENDIUM_CACHE) is shared by
    default, so an artifact an earlier run built is reused and what the notebook computes itself is
    checked; ``fresh_cache`` gives each thread count an empty cache folder (<out_dir>/cache-<n>, with
    the converted embedded models linked in), so every artifact is rebuilt at that thread count."""
    temporary = out_dir is None
    out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="compendium-stability-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    box = out_dir / "tree"
    if not box.exists():
        _sandbox(box)
    install_kernel_config(quiet=True)
    print(f"stability runs in {out_dir} (executed notebooks: threads-<n>/)", flush=True)
    try:
        return _stability_runs(notebooks, threads, fresh_cache, out_dir, box, timeout)
    finally:  # the copy of the tree goes; executed notebooks stay to read (fresh caches too, with --out)
        shutil.rmtree(box, ignore_errors=True)
        if temporary:
            for d in out_dir.glob("cache-*"):
                shutil.rmtree(d, ignore_errors=True)


def _stability_runs(notebooks: list[Path], threads: tuple[int, ...], fresh_cache: bool, out_dir: Path, box: Path,
                    timeout: int | None) -> dict[str, str]:
    report = {}
    for nb in notebooks:
        runs: dict[int, Path | str] = {}
        for n in threads:
            env = {**os.environ, **repro.quiet_env(), "COMPENDIUM_THREADS": str(n), "PYTHONPATH": os.pathsep.join(
                [str(box)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
            env.setdefault("HF_HUB_OFFLINE", "1")
            env["COMPENDIUM_CACHE"] = str(paths.CACHE)
            if fresh_cache:
                cache_dir = out_dir / f"cache-{n}"
                cache_dir.mkdir(exist_ok=True)
                if (paths.CACHE / "models").is_dir() and not (cache_dir / "models").exists():
                    (cache_dir / "models").symlink_to(paths.CACHE / "models", target_is_directory=True)
                env["COMPENDIUM_CACHE"] = str(cache_dir)
            target = out_dir / f"threads-{n}" / nb.name
            target.parent.mkdir(parents=True, exist_ok=True)
            src = box / "notebooks" / nb.name
            if not src.exists():  # a notebook from outside notebooks/ (tests): run it beside the others
                shutil.copy2(nb, src)
            cmd = [sys.executable, "-m", "papermill", str(src), str(target),
                   "--cwd", str(box / "notebooks"), "--log-level", "WARNING", "--no-progress-bar"]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                runs[n] = f"timed out after {timeout} s"
                continue
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
                runs[n] = f"failed (exit {proc.returncode}); see {target}\n" + "\n".join(tail)
            else:
                runs[n] = target
            print(f"{nb.stem}: COMPENDIUM_THREADS={n} ran in {time.perf_counter() - t0:.0f} s", flush=True)
        failed = {n: r for n, r in runs.items() if not isinstance(r, Path)}
        if failed:
            report[nb.stem] = "".join(f"COMPENDIUM_THREADS={n}: {r}\n" for n, r in failed.items())
            continue
        first = threads[0]
        problems = [] if key_cell_outputs(runs[first]) else [f"no key-number cell ({KEY_MARK}) in {nb.name}\n"]
        for n in threads[1:]:
            problems.append(compare_key_cells(runs[first], runs[n], f"COMPENDIUM_THREADS={first}",
                                              f"COMPENDIUM_THREADS={n}"))
        report[nb.stem] = "".join(problems)
    return report


# ----------------------------------------------------------------------------- make test (tests/Snakefile)


def test_command(job: str) -> list[str]:
    """The command of one job: pytest on lib/ ('tests'), or nbval on one notebook (the Makefile's flags)."""
    if job == "tests":
        return [sys.executable, "-m", "pytest", str(paths.ROOT / "tests"), "-q", "-p", "no:cacheprovider"]
    (nb,) = select_notebooks(job)
    return [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "--nbval-sanitize-with",
            str(SANITIZE_CFG), "-p", "no:cacheprovider", "-q", str(nb)]


AUDIT_BUDGET_S = 600.0  # recorded wall time of the records the audit of `make test` recomputes


def audit_seed() -> str:
    """The audit's seed: COMPENDIUM_AUDIT_SEED, else the current commit (so the sample rotates with the commit)."""
    return os.environ.get("COMPENDIUM_AUDIT_SEED", "").strip() or store._git("rev-parse", "HEAD") or "0"


def tree_state(root: Path = paths.ROOT) -> str | None:
    """``git status --porcelain`` of ``root`` (tracked changes and untracked files, ignored ones left out), or
    None outside a git work tree or without git."""
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def tree_changes(before: str | None, after: str | None) -> list[str]:
    """The lines of ``git status --porcelain`` that differ between two :func:`tree_state` snapshots."""
    if before is None or after is None:
        return []
    a, b = set(before.splitlines()), set(after.splitlines())
    return sorted(b - a) + [f"(no longer) {line}" for line in sorted(a - b)]


TEST_WORKFLOW = paths.ROOT / "tests" / "Snakefile"


def run_tests(jobs: list[str], workers: int | None = None, log_dir: Path | None = None,
              command=test_command, audit_budget: float | None = AUDIT_BUDGET_S,
              root: Path = paths.ROOT) -> dict[str, tuple[int, float]]:
    """Run the test jobs (notebook numbers, 'tests') through Snakemake (tests/Snakefile), ``workers`` at once, each
    with COMPENDIUM_THREADS = total // workers (total: COMPENDIUM_THREADS, 2 unless set; workers default to it), a
    notebook only after the notebooks it waits for (config/notebooks.yaml's ``needs`` and ``test_after``), the
    longest chain first. A failing job does not stop the others, nor the jobs that wait for it.
    Returns {job: (exit code, seconds)}. Each job's output goes to <log_dir>/<job>.log and is printed whole when
    the job fails. Every notebook's key numbers print the same at 1 and 2 threads (make test-stability), so the
    split changes how long the tests take, not what they check.

    The notebooks run in strict mode (``COMPENDIUM_RECORDS=strict``): they read the committed measurement
    records and compute none; a missing record fails its notebook, naming the command that builds it. With
    ``audit_budget`` (seconds of recorded wall time), a seeded sample of the tested notebooks' records
    (:func:`lib.infra.store.plan`, seed :func:`audit_seed`) is recomputed inside those runs and compared with the
    committed ones; the result is job 'audit' (exit 1 when a record is beyond its tolerance or was not
    recomputed), its report <log_dir>/audit.log.

    Tests publish nothing: when ``root`` is a git work tree, job 'tree' fails if its ``git status`` after the
    jobs differs from before (a tracked file changed, or a file appeared outside the ignored paths)."""
    total = repro.env_threads()
    workers = total if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    threads = max(1, total // workers)
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="compendium-test-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **repro.quiet_env(), "HF_HUB_OFFLINE": "1",
           store.RECORDS_ENV: "strict", paths.OUTPUTS_ENV: str(log_dir / "outputs")}
    plan_doc = None
    notebooks = [j for j in jobs if j != "tests"]
    if audit_budget is not None and notebooks:
        plan_doc = store.plan(audit_seed(), audit_budget, notebooks=notebooks)
        plan_path = log_dir / "audit-plan.json"
        atomic_write_text(plan_path, json.dumps(plan_doc, indent=1) + "\n")
        (log_dir / "audit.jsonl").unlink(missing_ok=True)
        env.update({store.AUDIT_PLAN_ENV: str(plan_path), store.AUDIT_LOG_ENV: str(log_dir / "audit.jsonl")})
        print(f"audit: {len(plan_doc['records'])} records to recompute (seed {plan_doc['seed'][:12]}, about "
              f"{plan_doc['estimate_s']:.0f} s recorded), in notebooks {', '.join(n[:2] for n in plan_doc['notebooks']) or 'none'}",
              flush=True)
    for j in jobs:  # what a previous run in this folder left would read as this run's result
        for suffix in (".rc", ".log", ".time"):
            (log_dir / f"{j}{suffix}").unlink(missing_ok=True)
    config = {"commands": {j: shlex.join(command(j)) for j in jobs}, "threads": threads, "cwd": str(paths.ROOT)}
    atomic_write_text(log_dir / "test-jobs.json", json.dumps(config, indent=1) + "\n")
    print(f"{len(jobs)} test jobs, {workers} at a time, COMPENDIUM_THREADS={threads} each; logs in {log_dir}",
          flush=True)
    tree_before = tree_state(root)
    t_all = time.perf_counter()
    snakemake = [sys.executable, "-m", "snakemake", "--snakefile", str(TEST_WORKFLOW), "--directory", str(log_dir),
                 "--configfile", str(log_dir / "test-jobs.json"), "--cores", str(threads * workers),
                 "--quiet", "rules", "--nolock", "--rerun-incomplete"]
    proc = subprocess.run(snakemake, env=env)
    wall = time.perf_counter() - t_all
    done = {}
    for j in jobs:
        rc_file, time_file = log_dir / f"{j}.rc", log_dir / f"{j}.time"
        rc = int(rc_file.read_text().strip() or 1) if rc_file.exists() else None
        secs = float(time_file.read_text().splitlines()[1].split("\t")[0]) if time_file.exists() else 0.0
        if rc is None:  # the workflow itself failed before this job ran
            done[j] = (proc.returncode or 1, 0.0)
            print(f"{j} did not run (Snakemake exit {proc.returncode})", flush=True)
            continue
        done[j] = (rc, secs)
        print(f"{j} {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s", flush=True)
        if rc != 0:
            print((log_dir / f"{j}.log").read_text(), flush=True)
    busy = sum(t for _, t in done.values())
    if plan_doc is not None and plan_doc["records"]:  # nothing committed to audit: no audit job
        ok, text = store.audit_report(plan_doc, log_dir / "audit.jsonl")
        atomic_write_text(log_dir / "audit.log", text + "\n")
        print(text, flush=True)
        done["audit"] = (0 if ok else 1, 0.0)
    changed = tree_changes(tree_before, tree_state(root))
    if tree_before is not None:
        done["tree"] = (1 if changed else 0, 0.0)
        print("the tests left the work tree as they found it (git status)" if not changed else
              "FAILED: the tests changed the work tree (git status):\n  " + "\n  ".join(changed), flush=True)
    print(f"all {len(done)} jobs in {wall:.0f} s ({busy:.0f} s of job time, {busy / max(wall, 1e-9):.2f} jobs at once on average)",
          flush=True)
    return done


# ----------------------------------------------------------------------------- make audit


def audit(notebooks: list[str] | None = None, budget: float = AUDIT_BUDGET_S, seed: str | None = None,
          out_dir: Path | None = None, timeout: int | None = None) -> tuple[bool, str]:
    """``make audit``: recompute a seeded sample of the committed records (:func:`lib.infra.store.plan`) on this machine
    and compare each with the committed one under its step's tolerance. Each notebook that reads a planned record
    runs once with papermill in strict mode, in a copy of lib/, notebooks/, data/ and params/ (so figures and
    ledgers stay out of the working tree), reading the repository's records and cache. Returns (passed, report)."""
    plan_doc = store.plan(seed or audit_seed(), budget, notebooks=notebooks)
    out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="compendium-audit-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path, log = out_dir / "audit-plan.json", out_dir / "audit.jsonl"
    atomic_write_text(plan_path, json.dumps(plan_doc, indent=1) + "\n")
    log.unlink(missing_ok=True)
    box = out_dir / "tree"
    if not box.exists():
        _sandbox(box)
    install_kernel_config(quiet=True)
    env = {**os.environ, **repro.quiet_env(), "PYTHONPATH": os.pathsep.join(
        [str(box)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "COMPENDIUM_CACHE": str(paths.CACHE), store.STORE_ENV: str(store.root()), store.RECORDS_ENV: "strict",
        store.AUDIT_PLAN_ENV: str(plan_path), store.AUDIT_LOG_ENV: str(log)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    print(f"audit: {len(plan_doc['records'])} records (seed {plan_doc['seed'][:12]}, about {plan_doc['estimate_s']:.0f} s "
          f"recorded) in notebooks {', '.join(n[:2] for n in plan_doc['notebooks']) or 'none'}; runs in {out_dir}", flush=True)
    try:
        for stem in plan_doc["notebooks"]:
            src = box / "notebooks" / f"{stem}.ipynb"
            cmd = [sys.executable, "-m", "papermill", str(src), str(out_dir / f"{stem}.ipynb"), "--cwd",
                   str(box / "notebooks"), "--log-level", "WARNING", "--no-progress-bar"]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                tail = "" if proc.returncode == 0 else "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            except subprocess.TimeoutExpired:
                tail = f"timed out after {timeout} s"
            print(f"{stem}: {time.perf_counter() - t0:.0f} s" + (f", FAILED:\n{tail}" if tail else ""), flush=True)
    finally:
        shutil.rmtree(box, ignore_errors=True)
    ok, text = store.audit_report(plan_doc, log)
    atomic_write_text(out_dir / "audit.log", text + "\n")
    return ok, text


# ----------------------------------------------------------------------------- student copies

SOLUTION_TAG = "solution"  # worked solutions: removed from student copies (their check cells stay)


def student_copies(notebooks: list[Path], out_dir: Path) -> list[Path]:
    """Student copies of ``notebooks`` in ``out_dir`` (make student): nbconvert's TagRemovePreprocessor
    drops the cells tagged ``solution`` and ClearOutputPreprocessor every output, so a student runs the
    notebook and answers the exercises. Each exercise keeps its function's signature and docstring (the
    cell under it) and its check cell (tag ``check``): ``check_<name>(<name>)`` from ``lib.exercises``,
    which compares the student's function with the reference solution; no cell holds an answer."""
    from nbconvert.exporters import NotebookExporter
    from traitlets.config import Config

    cfg = Config()
    cfg.TagRemovePreprocessor.enabled = True
    cfg.TagRemovePreprocessor.remove_cell_tags = {SOLUTION_TAG}
    cfg.ClearOutputPreprocessor.enabled = True
    exporter = NotebookExporter(config=cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in notebooks:
        body, _ = exporter.from_filename(str(nb))
        dest = out_dir / nb.name
        atomic_write_text(dest, body)
        written.append(dest)
    return written


def student_first_checks(notebooks: list[Path], timeout: int = 1800) -> list[tuple[str, float, str]]:
    """Each notebook's student copy executed (nbclient, from the committed records in strict mode, figures and
    ledger records to a temporary folder) up to its first check cell, which must fail with NotImplementedError
    (the student's function is not written yet) while every cell before it runs. Returns (notebook, seconds,
    problem or '') per notebook (make test-student)."""
    import nbformat
    from nbclient import NotebookClient

    out = []
    with tempfile.TemporaryDirectory(prefix="compendium-students-") as box:
        env = {store.RECORDS_ENV: "strict", paths.OUTPUTS_ENV: str(Path(box) / "outputs"), **repro.quiet_env()}
        saved = {k: os.environ.get(k) for k in [*env, paths.PUBLISH_ENV]}
        os.environ.update(env)  # the kernel inherits this process's environment
        os.environ.pop(paths.PUBLISH_ENV, None)
        try:
            for copy in student_copies(notebooks, Path(box) / "copies"):
                nb = nbformat.read(copy, as_version=4)
                first = next(i for i, c in enumerate(nb.cells) if "check" in c.get("metadata", {}).get("tags", []))
                nb.cells = nb.cells[:first + 1]
                t0 = time.perf_counter()
                NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                               resources={"metadata": {"path": str(paths.NOTEBOOKS)}}).execute()
                errors = [(i, o.ename) for i, c in enumerate(nb.cells) if c.cell_type == "code"
                          for o in c.outputs if o.output_type == "error"]
                problem = "" if errors == [(first, "NotImplementedError")] else f"errors (cell, name): {errors}"
                out.append((copy.stem, time.perf_counter() - t0, problem))
                print(f"{copy.stem}: {out[-1][1]:.0f} s" + (f", FAILED: {problem}" if problem else ""), flush=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


def claims(model_name: str, notebooks: list[str] | None = None) -> Path:
    return results.write_claims(model_name, notebooks)


# README.md's findings table (lib.infra.results.findings_table) sits between these two lines; `readme` rewrites it.
FINDINGS = ("<!-- findings: generated by `python -m lib readme` from results/<model>/claims.json -->",
            "<!-- /findings -->")


def readme_with_findings(text: str, table: str) -> str:
    """``text`` (README.md) with the block between the :data:`FINDINGS` markers set to ``table``; the rest
    stays byte for byte."""
    start, end = FINDINGS
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"README.md needs one {start!r} line followed by one {end!r} line")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n\n" + table.rstrip("\n") + "\n\n" + end + tail


def readme_findings(text: str) -> str:
    """The table between README.md's :data:`FINDINGS` markers, without the blank lines around it."""
    start, end = FINDINGS
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def write_readme(readme: Path | None = None, models: list[str] | None = None) -> bool:
    """Rewrite README.md's findings table from the committed ledgers (atomically); True when it changed."""
    readme = readme or paths.ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = readme_with_findings(text, results.findings_table(models))
    if new != text:
        atomic_write_text(readme, new)
    return new != text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lib", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    r.add_argument("--no-publish", action="store_true",
                   help="write figures and ledger records to the run folder, not the published ones")
    c = sub.add_parser("claims", help="write results/<model>/claims.md")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--notebooks", default=None, help="merge only these notebooks' records (e.g. 04,05)")
    m = sub.add_parser("merge", help="write results/claims.md: findings x models")
    m.add_argument("--models", nargs="*", default=None, help="columns, in order (default: every model with records)")
    rd = sub.add_parser("readme", help="rewrite README.md's findings table from results/<model>/claims.json")
    rd.add_argument("--models", nargs="*", default=None,
                    help="columns, in order (default: the notebooks' default models, then every other model with a ledger)")
    rc = sub.add_parser("recover", help="remove a killed run's stale Snakemake lock and .partial notebooks")
    rc.add_argument("--workdir", default=str(paths.ROOT), help="the workflow's folder (default: the repository)")
    st = sub.add_parser("stability", help="key-number cells must print the same at 1 and 2 threads")
    st.add_argument("--notebooks", default=None, help="two-digit numbers, e.g. 00,07 (default: every numbered one)")
    st.add_argument("--threads", default="1,2", help="COMPENDIUM_THREADS values to compare (default 1,2)")
    st.add_argument("--fresh-cache", action="store_true",
                    help="an empty cache folder per thread count (every artifact rebuilt; slow)")
    st.add_argument("--out", default=None, help="folder for the runs (default: a new temporary folder)")
    st.add_argument("--timeout", type=int, default=None, help="seconds per notebook run")
    su = sub.add_parser("student", help="student copies: solutions removed, outputs cleared, checks kept")
    su.add_argument("--notebooks", default=None, help="two-digit numbers, e.g. 00,07 (default: every numbered one)")
    su.add_argument("--out", default=str(paths.ROOT / "students"), help="folder for the copies (default: students/)")
    su.add_argument("--run", action="store_true",
                    help="instead of writing copies, run each copy up to its first check (make test-student)")
    sub.add_parser("kernel-config", help="install the kernel config that quiets the TCP warning into the venv")
    au = sub.add_parser("audit", help="recompute a seeded sample of the committed records and compare (make audit)")
    au.add_argument("--notebooks", default=None, help="only records built by these notebooks, e.g. 03,05")
    au.add_argument("--budget", type=float, default=AUDIT_BUDGET_S, help="seconds of recorded wall time to recompute")
    au.add_argument("--seed", default=None, help="default: COMPENDIUM_AUDIT_SEED, else the current commit")
    au.add_argument("--out", default=None, help="folder for the runs and the report (default: a new temporary folder)")
    te = sub.add_parser("test", help="pytest on lib/ and nbval on the notebooks, several at once (make test)")
    te.add_argument("--notebooks", default=None, help="two-digit numbers, e.g. 00,07 (default: every numbered one)")
    te.add_argument("--no-lib", action="store_true", help="only the notebooks (make test-notebooks)")
    te.add_argument("--workers", type=int, default=None, help="jobs at once (default: COMPENDIUM_THREADS, 2 unless set)")
    te.add_argument("--logs", default=None, help="folder for the jobs' logs (default: a new temporary folder)")
    te.add_argument("--no-audit", action="store_true", help="no recomputed sample of records (make test-notebooks)")
    args = ap.parse_args(argv)
    if args.cmd == "recover":
        for line in recover(Path(args.workdir)):
            print(line)
    elif args.cmd == "student":
        if args.run:
            t0 = time.perf_counter()
            report = student_first_checks(select_notebooks(args.notebooks))
            print(f"{len(report)} student copies run to their first check: {time.perf_counter() - t0:.0f} s")
            if any(problem for _, _, problem in report):
                raise SystemExit(1)
        else:
            for path in student_copies(select_notebooks(args.notebooks), Path(args.out)):
                print(path)
    elif args.cmd == "kernel-config":
        path = install_kernel_config()
        if path:
            os.utime(path)  # newer than lib/infra/runner.py: make's target is up to date
            print(path)
    elif args.cmd == "stability":
        threads = tuple(int(t) for t in args.threads.split(",") if t.strip())
        if len(threads) < 2 or min(threads) < 1:
            raise SystemExit(f"--threads needs at least two positive counts, got {args.threads!r}")
        out = Path(args.out) if args.out else None
        report = stability(select_notebooks(args.notebooks), threads, args.fresh_cache, out, args.timeout)
        bad = {k: v for k, v in report.items() if v}
        for k, v in report.items():
            print(f"{k}: {'same key numbers at COMPENDIUM_THREADS=' + ' and '.join(map(str, threads)) if not v else 'DIFFERS'}")
        for k, v in bad.items():
            print(f"\n--- {k}\n{v}", end="" if v.endswith("\n") else "\n")
        if bad:
            raise SystemExit(f"{len(bad)} of {len(report)} notebook(s) print different key numbers or failed")
    elif args.cmd == "test":
        jobs = ([] if args.no_lib else ["tests"]) + [p.name[:2] for p in select_notebooks(args.notebooks)]
        done = run_tests(jobs, args.workers, Path(args.logs) if args.logs else None,
                         audit_budget=None if args.no_audit else AUDIT_BUDGET_S)
        bad = sorted(j for j, (rc, _) in done.items() if rc != 0)
        if bad:
            raise SystemExit(f"{len(bad)} of {len(done)} test jobs failed: {', '.join(bad)}")
    elif args.cmd == "audit":
        nbs = [n.name[:2] for n in select_notebooks(args.notebooks)] if args.notebooks else None
        ok, _ = audit(nbs, args.budget, args.seed, Path(args.out) if args.out else None)
        print("audit passed" if ok else "audit FAILED")
        if not ok:
            raise SystemExit(1)
    elif args.cmd == "run":
        print(json.dumps(run(Path(args.notebook), args.model, device=args.device, atomic=args.atomic,
                             device_map=args.device_map, publish=not args.no_publish)))
    elif args.cmd == "merge":
        print(results.merge_claims(args.models or None))
    elif args.cmd == "readme":
        changed = write_readme(models=args.models or None)
        print(f"README.md: findings table {'rewritten' if changed else 'already current'}")
    elif args.cmd == "all":
        seen = []
        for nb in index.numbered_notebooks():
            rec = run(nb, args.model, device=args.device)
            print(json.dumps(rec), flush=True)
            seen.append(rec["model"])
        for m in sorted(set(seen)):
            print(claims(m))
    else:
        print(claims(args.model, [n.strip() for n in args.notebooks.split(",") if n.strip()] if args.notebooks else None))


if __name__ == "__main__":
    main()
