"""The measurement store: what an expensive step measured, kept as a committed record.

A record is the compact output of one measurement (per-prompt continuations and toxicity scores, per-text
perplexities, per-neuron mean activations, a probe's weights, ...), never model weights. It lives in

    results/<model>/measurements/<step>/<key>.json[.gz]

and its key hashes the step, its parameters (with the content hash of every data set it read, so one
changed prompt or fact is a new record) and the step's method version (``STEPS``, bumped by hand when the
step's meaning changes: a refactor that computes the same thing keeps every key). Each record carries its
provenance: commit, package versions, device, CPU model, threads, wall time, date and the notebook that
built it; ``python -m lib.infra.store manifest`` lists them all in ``results/<model>/measurements/MANIFEST.md``.

:func:`measure` is the one way a step reads or writes its record. What it does depends on
``COMPENDIUM_RECORDS``:

* ``use`` (default, a notebook run by hand, ``make reproduce``): read the record; when it is missing,
  compute it and write it atomically (an interrupted run loses only the record being computed);
* ``strict`` (``make test``, CI): read the record; a missing one is an error naming the record and the
  command that builds it. Nothing is computed or written;
* ``fresh`` (``make reproduce FRESH=1``): compute every record again and overwrite it.

The analysis (bootstraps, controls, verdicts) runs on the records, so it prints the same on any machine.

**Audit.** With ``COMPENDIUM_AUDIT_PLAN`` naming a plan (:func:`plan`: a seeded sample of records, at least
one of each step, within a time budget), :func:`measure` recomputes each planned record from scratch on
this machine, compares it with the committed one under the step's stated tolerance (``STEPS[...].compare``)
and appends the comparison to ``COMPENDIUM_AUDIT_LOG``; the notebook still receives the committed record,
so its outputs stay those of the repository. :func:`audit_report` reads the log back: it fails when a
record is beyond its tolerance or a planned record was never recomputed.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import gzip
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lib.infra import index, paths
from lib.infra.cache import atomic_write_text, content_hash

RECORDS_ENV = "COMPENDIUM_RECORDS"
MODES = ("use", "strict", "fresh")
AUDIT_PLAN_ENV = "COMPENDIUM_AUDIT_PLAN"
AUDIT_LOG_ENV = "COMPENDIUM_AUDIT_LOG"
STORE_ENV = "COMPENDIUM_STORE"  # another root than results/ (tests)
FRESH_SINCE_ENV = "COMPENDIUM_FRESH_SINCE"  # 'fresh' mode: records written since this UTC time are this rebuild's
NOTEBOOK_ENV = "COMPENDIUM_NOTEBOOK"  # the notebook this process runs (lib.nb.start sets it; worker processes inherit it)
FOLDER = "measurements"
GZIP_ABOVE = 32_768  # bytes of JSON above which a record is gzipped (small ones stay plain, diffable text)
LIST_ABOVE = 64  # numeric arrays longer than this are stored as base64 of their bytes (exact, compact)
PACKAGES = ("torch", "transformers", "trl", "numpy", "scipy", "scikit-learn", "pandas", "profanity-check", "detoxify")


class MissingRecord(RuntimeError):
    """A record that ``make test`` (strict mode) needs is not in the repository."""


class AuditFailure(AssertionError):
    """A recomputed record disagrees with the committed one beyond its tolerance."""


# ----------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class Step:
    """One kind of record: its method version (part of every key: bump it by hand when the step's
    meaning changes) and how the audit compares a recomputed record with the committed one:
    ``compare(committed, fresh) -> list[Check]``, each check a quantity within its stated tolerance."""
    name: str
    version: int
    doc: str
    compare: Callable[[Any, Any], list["Check"]] | None = None


@dataclasses.dataclass(frozen=True)
class Check:
    quantity: str
    committed: float
    fresh: float
    tolerance: str  # the rule, in words and numbers
    ok: bool
    info: bool = False  # reported, not decided (e.g. the share of identical continuations)

    def line(self) -> str:
        mark = "info" if self.info else ("ok" if self.ok else "BEYOND")
        return f"{self.quantity}: committed {self.committed:.6g}, recomputed {self.fresh:.6g} ({self.tolerance}) {mark}"


STEPS: dict[str, Step] = {}


def step(name: str, version: int, doc: str, compare: Callable | None = None) -> Step:
    """Declare a kind of record (each paper's module declares its own, once, at import)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a step name is a plain folder name, got {name!r}")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    s = Step(name, version, doc, compare)
    STEPS[name] = s
    return s


# ----------------------------------------------------------------------------- where records live


def root() -> Path:
    return Path(os.environ.get(STORE_ENV) or paths.RESULTS)


def folder(model_name: str) -> Path:
    return root() / paths.slug(model_name) / FOLDER


def key_of(step_name: str, params: dict, inputs: Any = None) -> str:
    """The key :func:`measure` gives these parameters (to name a record inside another one's key)."""
    extra = {"inputs": content_hash(inputs)} if inputs is not None else {}
    return record_key(step_name, {**dict(params), **extra}, STEPS[step_name].version)


def exists(step_name: str, model_name: str, params: dict, inputs: Any = None) -> bool:
    """Whether :func:`measure` would read this record rather than compute it (False in 'fresh' mode)."""
    return mode() != "fresh" and locate(model_name, step_name, key_of(step_name, params, inputs)) is not None


def mode() -> str:
    raw = os.environ.get(RECORDS_ENV, "").strip().lower() or "use"
    if raw not in MODES:
        raise ValueError(f"{RECORDS_ENV} must be one of {', '.join(MODES)}, got {raw!r}")
    return raw


def _plain(obj: Any) -> Any:
    """Parameters as plain JSON (tuples as lists, numpy scalars as numbers, other objects as text)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def record_key(step_name: str, params: dict, version: int) -> str:
    blob = json.dumps({"step": step_name, "version": version, "params": _plain(params)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def locate(model_name: str, step_name: str, key: str) -> Path | None:
    """The record's file (plain or gzipped), or None."""
    base = folder(model_name) / step_name
    for name in (f"{key}.json", f"{key}.json.gz"):
        if (base / name).exists():
            return base / name
    return None


def record_id(p: Path) -> str:
    """A record's name in plans and audit logs: its path under the store's root ('<model>/measurements/<step>/<file>')."""
    p = Path(p)
    return str(p.relative_to(root())) if p.is_relative_to(root()) else str(p)


def _relative(p: Path) -> str:
    p = Path(p)
    return str(p.relative_to(paths.ROOT)) if p.is_relative_to(paths.ROOT) else str(p)


# ----------------------------------------------------------------------------- encoding


def encode(obj: Any) -> Any:
    """A JSON-able form of ``obj``, exact: numbers, text, lists, tuples, dicts, numpy arrays and torch
    tensors (dtype and shape kept; long numeric ones as base64 of their little-endian bytes), pandas
    frames and series (columns, dtypes, index, attrs)."""
    import pandas as pd

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, pd.DataFrame):
        return {"__frame__": [encode(c) for c in obj.columns],
                "data": [encode(obj[c].to_numpy()) for c in obj.columns],
                "index": encode(obj.index.to_numpy()), "index_name": encode(obj.index.name),
                "attrs": encode(dict(obj.attrs))}
    if isinstance(obj, pd.Series):
        return {"__series__": encode(obj.name), "data": encode(obj.to_numpy()), "index": encode(obj.index.to_numpy())}
    torch_tensor = False
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            torch_tensor = str(obj.dtype).replace("torch.", "")
            t = obj.detach().cpu()
            obj = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, np.ndarray):
        head = {"__array__": str(obj.dtype), "shape": list(obj.shape), **({"torch": torch_tensor} if torch_tensor else {})}
        if obj.dtype == object or obj.dtype.kind in "US":
            return {**head, "__array__": "object" if obj.dtype == object else str(obj.dtype),
                    "data": [encode(v) for v in obj.ravel().tolist()]}
        if obj.size <= LIST_ABOVE:
            return {**head, "data": obj.ravel().tolist()}
        return {**head, "b64": base64.b64encode(np.ascontiguousarray(obj).astype(obj.dtype.newbyteorder("<")).tobytes()).decode()}
    raise TypeError(f"a record cannot hold a {type(obj).__name__}: give numbers, text, lists, dicts, arrays, "
                    "tensors or pandas frames")


def decode(obj: Any) -> Any:
    """The inverse of :func:`encode`."""
    import pandas as pd

    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__frame__" in obj:
        cols = [decode(c) for c in obj["__frame__"]]
        df = pd.DataFrame({i: decode(d) for i, d in enumerate(obj["data"])})
        df.columns = cols
        df.index = pd.Index(decode(obj["index"]), name=decode(obj["index_name"]))
        df.attrs.update(decode(obj["attrs"]))
        return df
    if "__series__" in obj:
        return pd.Series(decode(obj["data"]), index=decode(obj["index"]), name=decode(obj["__series__"]))
    if "__array__" in obj:
        dtype, shape = obj["__array__"], tuple(obj["shape"])
        if dtype == "object":
            arr = np.empty(len(obj["data"]), dtype=object)
            arr[:] = [decode(v) for v in obj["data"]]
            arr = arr.reshape(shape)
        elif "b64" in obj:
            arr = np.frombuffer(base64.b64decode(obj["b64"]), dtype=np.dtype(dtype).newbyteorder("<"))
            arr = arr.astype(np.dtype(dtype)).reshape(shape)
        else:
            arr = np.array(obj["data"], dtype=np.dtype(dtype)).reshape(shape)
        if obj.get("torch"):
            import torch

            t = torch.from_numpy(arr.copy())
            return t.view(torch.bfloat16) if obj["torch"] == "bfloat16" else t
        return arr
    return {k: decode(v) for k, v in obj.items()}


def _hashable(x):
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x


# ----------------------------------------------------------------------------- provenance


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=paths.ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(wall_s: float, device: str | None = None) -> dict:
    """Where and how a record was made: commit (with '+changes' when the tree differed from it), package
    versions, device, CPU model, threads, wall time, UTC date and the notebook being run."""
    from importlib import metadata

    versions = {}
    for p in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[p] = metadata.version(p)
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no", "--", "lib", "notebooks"):
        commit += "+changes"
    threads = None
    with contextlib.suppress(ImportError):
        import torch

        threads = torch.get_num_threads()
    notebook = os.environ.get(NOTEBOOK_ENV) or None
    return {"commit": commit or "unknown", "packages": versions, "python": platform.python_version(),
            "device": device or "cpu", "cpu": cpu_model(), "threads": threads, "wall_s": round(float(wall_s), 2),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "notebook": notebook}


# ----------------------------------------------------------------------------- reading and writing


def read(path: Path) -> dict:
    """The whole record (step, key, params, provenance, data still encoded)."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = gzip.decompress(raw).decode("utf-8") if path.suffix == ".gz" else raw.decode("utf-8")
        doc = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"record {_relative(path)} is unreadable ({type(e).__name__}: {e}); rebuild it "
                         f"(COMPENDIUM_RECORDS=fresh) or restore it with git") from None
    for k in ("step", "key", "version", "params", "data"):
        if k not in doc:
            raise ValueError(f"record {_relative(path)} lacks its {k!r}: rebuild it or restore it with git")
    return doc


def write(model_name: str, step_name: str, key: str, params: dict, version: int, data: Any,
          prov: dict) -> Path:
    doc = {"step": step_name, "key": key, "version": version, "model": model_name, "params": _plain(params),
           "provenance": prov, "data": encode(data)}
    # dicts keep their order (a notebook iterates them); the parameters are sorted by _plain
    text = json.dumps(doc, ensure_ascii=False, allow_nan=True, separators=(",", ":")) + "\n"
    base = folder(model_name) / step_name
    plain, gz = base / f"{key}.json", base / f"{key}.json.gz"
    if len(text.encode()) > GZIP_ABOVE:
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".{key}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
            os.replace(tmp, gz)
        finally:
            tmp.unlink(missing_ok=True)
        plain.unlink(missing_ok=True)
        return gz
    atomic_write_text(plain, text)
    gz.unlink(missing_ok=True)
    return plain


def _notebook_command(model_name: str) -> str:
    notebook = os.environ.get(NOTEBOOK_ENV) or None
    model = "" if notebook and _is_default_model(notebook, model_name) else f" MODEL={model_name}"
    return f"make reproduce{model}" + (f" NOTEBOOKS={notebook[:2]}" if notebook else "")


def _is_default_model(notebook: str, model_name: str) -> bool:
    try:
        return paths.slug(index.default_model(paths.NOTEBOOKS / f"{notebook}.ipynb")) == paths.slug(model_name)
    except Exception:  # noqa: BLE001 - only for wording the hint
        return False


def measure(step_name: str, model_name: str, params: dict, build: Callable[[], Any], *,
            to_record: Callable[[Any], Any] | None = None, from_record: Callable[[Any], Any] | None = None,
            device: str | None = None, inputs: Any = None, produces: str | None = None) -> Any:
    """The measurement of ``step_name`` (declared with :func:`step`) for ``model_name`` with ``params``:
    read from its record, or computed by ``build()`` and written (see the module's text for the modes and
    the audit). ``inputs``: data the step reads, hashed into the key (:func:`lib.infra.cache.content_hash`);
    data may also sit in ``params`` as its own content hash. ``to_record`` turns what ``build`` returns into
    what the record keeps (numbers, text, lists, dicts, arrays, frames); ``from_record`` turns it back.
    Returns ``from_record(record)``, so a computed and a read measurement look alike. ``produces``: the name of
    a model this step makes (a fine-tuning run), kept in the provenance: the audit's plan adds this record's wall
    time to the cost of every record that measures that model (recomputing one may mean training it again)."""
    return measure_many(step_name, model_name, [params], lambda idx: [build()], to_record=to_record,
                        from_record=from_record, device=device, inputs=inputs, produces=produces)[0]


def measure_many(step_name: str, model_name: str, params_list: list[dict], build_many: Callable[[list[int]], list],
                 *, to_record: Callable[[Any], Any] | None = None, from_record: Callable[[Any], Any] | None = None,
                 device: str | None = None, inputs: Any = None, produces: str | None = None) -> list:
    """:func:`measure` for several records of one step at once: ``build_many(indices)`` computes the
    measurements of ``params_list[i]`` for those indices in one go (e.g. one batched generation), called
    once for all missing records; each is written as its own record (the batch's wall time shared out)."""
    if step_name not in STEPS:
        raise KeyError(f"unknown step {step_name!r}: declare it with lib.infra.store.step (known: {', '.join(sorted(STEPS))})")
    st = STEPS[step_name]
    to_record = to_record or (lambda x: x)
    from_record = from_record or (lambda x: x)
    extra = {"inputs": content_hash(inputs)} if inputs is not None else {}
    params_list = [{**dict(p), **extra} for p in params_list]
    keys = [record_key(step_name, p, st.version) for p in params_list]
    m = mode()
    out: list = [None] * len(keys)
    missing = []
    since = os.environ.get(FRESH_SINCE_ENV, "").strip()
    for i, key in enumerate(keys):
        found = locate(model_name, step_name, key)
        doc = read(found) if found is not None else None
        # 'fresh' measures every record again, once: one that this rebuild already wrote (another notebook asked
        # for it first) is read
        if doc is None or (m == "fresh" and not (since and doc.get("provenance", {}).get("date", "") >= since)):
            missing.append(i)
            continue
        committed = decode(doc["data"])
        if _planned(found):
            _audit(found, st, committed, lambda i=i: build_many([i])[0], to_record)
        out[i] = from_record(committed)
    if missing and m == "strict":
        where = folder(model_name) / step_name / f"{keys[missing[0]]}.json[.gz]"
        more = f" and {len(missing) - 1} more of this step" if len(missing) > 1 else ""
        raise MissingRecord(f"missing record {_relative(where)}{more} (step {step_name!r}, method version {st.version}): "
                            f"make test computes no measurement; build it with `{_notebook_command(model_name)}` "
                            f"and commit {_relative(folder(model_name))}/")
    if missing:
        t0 = time.perf_counter()
        built = build_many(missing)
        if len(built) != len(missing):
            raise RuntimeError(f"{step_name}: build_many returned {len(built)} results for {len(missing)} records")
        prov = provenance((time.perf_counter() - t0) / len(missing), device)
        if produces:
            prov["produces"] = produces
        for i, obj in zip(missing, built):
            path = write(model_name, step_name, keys[i], params_list[i], st.version, to_record(obj), prov)
            out[i] = from_record(decode(read(path)["data"]))  # what a later run reads: exactly the same objects
    return out


# ----------------------------------------------------------------------------- audit


def _audit_plan() -> set[str]:
    p = os.environ.get(AUDIT_PLAN_ENV, "").strip()
    if not p:
        return set()
    return set(json.loads(Path(p).read_text())["records"])


def _audited() -> set[str]:
    """Records the audit log already holds (another notebook of the same run read them first)."""
    log = os.environ.get(AUDIT_LOG_ENV, "").strip()
    if not log or not Path(log).exists():
        return set()
    return {json.loads(line)["record"] for line in Path(log).read_text().splitlines() if line.strip()}


def _planned(path: Path) -> bool:
    """A record of the audit's plan that no notebook of this run has recomputed yet."""
    rid = record_id(path)
    return rid in _audit_plan() and rid not in _audited()


_AUDITING = [False]


def auditing() -> bool:
    """True while the audit recomputes a record: a build that could reuse a local artifact (a trained model in
    :mod:`lib.infra.cache`) measures from scratch instead, so the audit compares a new measurement, not a copy."""
    return _AUDITING[0]


def _audit(path: Path, st: Step, committed: Any, build: Callable[[], Any], to_record: Callable) -> None:
    """Recompute a planned record, compare it with the committed one, log it, and raise beyond tolerance."""
    t0 = time.perf_counter()
    _AUDITING[0] = True
    try:
        fresh = decode(encode(to_record(build())))
    finally:
        _AUDITING[0] = False
    wall = time.perf_counter() - t0
    checks = st.compare(committed, fresh) if st.compare else [_equal_check(committed, fresh)]
    entry = {"record": record_id(path), "step": st.name, "cpu": cpu_model(), "wall_s": round(wall, 1),
             "ok": all(c.ok or c.info for c in checks), "checks": [dataclasses.asdict(c) for c in checks]}
    log = os.environ.get(AUDIT_LOG_ENV, "").strip()
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    print(f"audit {entry['record']}: " + "; ".join(c.line() for c in checks))
    if not entry["ok"]:
        raise AuditFailure(f"record {entry['record']} recomputed on this machine ({entry['cpu']}) disagrees beyond "
                           "its tolerance: " + "; ".join(c.line() for c in checks if not (c.ok or c.info)))


def _equal_check(committed, fresh) -> Check:
    same = content_hash(encode(committed)) == content_hash(encode(fresh))
    return Check("identical record", 1.0, float(same), "must be identical (no tolerance stated)", same)


def within(quantity: str, committed: float, fresh: float, tol: float, rule: str) -> Check:
    """A check that |fresh - committed| <= tol, ``rule`` saying where tol comes from."""
    committed, fresh = float(committed), float(fresh)
    ok = bool(np.isfinite(committed) and np.isfinite(fresh) and abs(fresh - committed) <= tol) or \
        bool(np.isnan(committed) and np.isnan(fresh))
    return Check(quantity, committed, fresh, f"|difference| <= {tol:.3g}: {rule}", ok)


def at_least(quantity: str, value: float, floor: float, rule: str, committed: float = 1.0) -> Check:
    return Check(quantity, float(committed), float(value), f">= {floor:g}: {rule}", bool(value >= floor))


def info(quantity: str, committed: float, fresh: float, what: str) -> Check:
    return Check(quantity, float(committed), float(fresh), what, True, info=True)


def half_width(values, level: float = 0.95) -> float:
    """Half-width of the normal-approximation interval of a mean of ``values`` (its standard error times
    the normal quantile): the measurement's own uncertainty, the unit of the audit's tolerances."""
    from scipy import stats as st

    v = np.asarray(values, dtype=float)
    if v.size < 2:
        return float("nan")
    return float(st.norm.ppf(0.5 + level / 2) * v.std(ddof=1) / np.sqrt(v.size))


def inventory(model_names: list[str] | None = None) -> list[dict]:
    """Every committed record: {"record", "model", "step", "wall_s", "notebook", ...} (provenance read from it)."""
    out = []
    base = root()
    models = model_names or sorted(p.parent.name for p in base.glob(f"*/{FOLDER}") if p.is_dir())
    for m in models:
        for p in sorted((base / paths.slug(m) / FOLDER).glob("*/*.json*")):
            doc = read(p)
            prov = doc.get("provenance", {})
            out.append({"record": record_id(p), "model": doc.get("model", m), "step": doc["step"], "bytes": p.stat().st_size,
                        "wall_s": prov.get("wall_s", 0.0), "notebook": prov.get("notebook"), "cpu": prov.get("cpu"),
                        "commit": prov.get("commit"), "date": prov.get("date"), "produces": prov.get("produces"),
                        "names": sorted(_strings(doc.get("params", {})))})
    return out


def _strings(obj) -> set:
    """Every text value in a record's parameters (the names of the models it measured among them)."""
    if isinstance(obj, str):
        return {obj}
    if isinstance(obj, dict):
        return set().union(*map(_strings, obj.values())) if obj else set()
    if isinstance(obj, list):
        return set().union(*map(_strings, obj)) if obj else set()
    return set()


def _costs(rows: list[dict]) -> dict:
    """Seconds to recompute each record: its own wall time, plus that of every record that produced a model it
    measures (a fine-tuned model the audit's machine may have to train first)."""
    made = {r["produces"]: r["wall_s"] for r in rows if r.get("produces")}
    def measures(r: dict, name: str) -> bool:  # the model itself or a named stage of it ('<name>-halfway')
        return name != r.get("produces") and any(n == name or n.startswith(name + "-") for n in r["names"])
    return {r["record"]: r["wall_s"] + sum(w for name, w in made.items() if measures(r, name)) for r in rows}


def plan(seed: str, budget_s: float = 600.0, model_names: list[str] | None = None,
         notebooks: list[str] | None = None) -> dict:
    """A seeded sample of committed records to recompute: one of each step (the first in an order that the
    seed shuffles, preferring records whose cost fits the budget), then more in that order while their costs fit
    ``budget_s`` (a record's cost: its recorded wall time plus that of the run that produced a model it measures). ``notebooks``: only records built by these notebooks (stems or
    two-digit numbers). Returns {"seed", "budget_s", "records": [paths], "estimate_s"}."""
    rows = inventory(model_names)
    if notebooks is not None:
        keep = {n[:2] for n in notebooks}
        rows = [r for r in rows if (r["notebook"] or "")[:2] in keep]
    cost = _costs(inventory(model_names))  # a producer may sit in another notebook's records
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['record']}".encode()).hexdigest())
    chosen, spent = [], 0.0
    for s in sorted({r["step"] for r in rows}):
        of_step = [r for r in order if r["step"] == s]
        fits = [r for r in of_step if spent + cost[r["record"]] <= budget_s] or sorted(of_step, key=lambda r: cost[r["record"]])
        chosen.append(fits[0])
        spent += cost[fits[0]["record"]]
    for r in order:
        if r not in chosen and spent + cost[r["record"]] < budget_s:
            chosen.append(r)
            spent += cost[r["record"]]
    return {"seed": seed, "budget_s": budget_s, "records": sorted(r["record"] for r in chosen),
            "estimate_s": round(spent, 1), "notebooks": sorted({r["notebook"] for r in chosen if r["notebook"]})}


def audit_report(plan_doc: dict, log_path: Path) -> tuple[bool, str]:
    """(passed, text) from an audit log: every planned record recomputed and within its tolerance."""
    entries = []
    if Path(log_path).exists():
        entries = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    seen: dict[str, dict] = {}
    for e in entries:  # a record two notebooks recomputed at once: both comparisons count
        first = seen.setdefault(e["record"], e)
        if first is not e:
            first["ok"] = first["ok"] and e["ok"]
            first["checks"] = first["checks"] + [c for c in e["checks"] if not (c["ok"] or c["info"])]
    lines, ok = [], True
    for rec in plan_doc["records"]:
        e = seen.get(rec)
        if e is None:
            ok = False
            lines.append(f"NOT RECOMPUTED {rec}: no notebook asked for it in this run (a record no notebook "
                         "reads any more? rebuild the store with `make reproduce FRESH=1`)")
            continue
        ok &= e["ok"]
        lines.append(f"{'ok' if e['ok'] else 'BEYOND TOLERANCE'} {rec} ({e['wall_s']:.0f} s on {e['cpu']})")
        lines += [f"    {Check(**c).line()}" for c in e["checks"]]
    head = (f"audit of {len(plan_doc['records'])} records (seed {plan_doc['seed']}): "
            f"{'all within tolerance' if ok else 'FAILED'}")
    return ok, "\n".join([head, *lines])


def manifest(model_name: str) -> Path:
    """Write results/<model>/measurements/MANIFEST.md: every record with its step, size and provenance."""
    rows = inventory([model_name])
    total = sum(r["bytes"] for r in rows)
    lines = [f"# Measurement records of {model_name}", "",
             "Written by `python -m lib.infra.store manifest` (run by `make reproduce`); one row per record, from the "
             "provenance inside each record. Records are read by the notebooks (`lib.infra.store.measure`).", "",
             f"{len(rows)} records, {total / 1e6:.2f} MB.", "",
             "| step | record | notebook | kB | wall (s) | CPU | commit | date |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | `{Path(r['record']).name}` | {r['notebook'] or ''} | {r['bytes'] / 1e3:.0f} | "
                     f"{r['wall_s']:.1f} | {r['cpu'] or ''} | {r['commit'] or ''} | {r['date'] or ''} |")
    target = folder(model_name) / "MANIFEST.md"
    atomic_write_text(target, "\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="The measurement store (lib/infra/store.py).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="write results/<model>/measurements/MANIFEST.md for every model with records")
    m.add_argument("--model", default=None)
    p = sub.add_parser("plan", help="print an audit plan (JSON) for this seed")
    p.add_argument("--seed", default=None, help="default: the current commit")
    p.add_argument("--budget", type=float, default=600.0, help="seconds of recorded wall time to recompute")
    p.add_argument("--notebooks", default=None)
    sub.add_parser("size", help="committed size of the store, per model and step")
    args = ap.parse_args(argv)
    if args.cmd == "manifest":
        models = [args.model] if args.model else sorted(p.parent.name for p in root().glob(f"*/{FOLDER}") if p.is_dir())
        for mdl in models:
            print(_relative(manifest(mdl)))
    elif args.cmd == "plan":
        nbs = args.notebooks.split(",") if args.notebooks else None
        print(json.dumps(plan(args.seed or _git("rev-parse", "HEAD") or "0", args.budget, notebooks=nbs), indent=1))
    else:
        rows = inventory()
        by: dict = {}
        for r in rows:
            by.setdefault((r["model"], r["step"]), [0, 0])
            by[(r["model"], r["step"])][0] += 1
            by[(r["model"], r["step"])][1] += r["bytes"]
        for (mdl, s), (n, b) in sorted(by.items()):
            print(f"{mdl:16s} {s:24s} {n:5d} records {b / 1e6:8.2f} MB")
        print(f"total {sum(r['bytes'] for r in rows) / 1e6:.2f} MB in {len(rows)} records")


if __name__ == "__main__":
    main()
