#!/usr/bin/env python
"""Benchmarks: how fast the compendium does its work, next to the alternatives.

    python benchmarks/bench.py                      # all five items, writes benchmarks/RESULTS.md
    python benchmarks/bench.py --device cuda        # the same on a GPU (adds nothing else; --dtype bfloat16 for bf16)
    python benchmarks/bench.py time "make test" -- make test   # time one of the compendium's commands (item 5)

Items (one run, same inputs):

1. ``lib.hooks.mlp_activation_stats`` (all layers, positions 'all') vs a bare forward of the same
   model on the same batches with ``logits_to_keep=1``.
2. The same statistics through TransformerLens 4 (``run_with_cache`` on ``blocks.L.mlp.hook_post``,
   then a masked mean): time ratio, and extra peak memory over the loaded model, each method in a
   fresh subprocess.
3. Batched greedy generation (``lib.metrics.generate``) vs a per-prompt ``model.generate`` loop:
   tokens per second.
4. Scaling of pass 1 with the number of prompts: time per prompt and extra peak memory (fresh
   subprocess per size).
5. The compendium's own commands, each timed as a whole on this machine by ``bench.py time LABEL -- COMMAND``
   (kept in ``benchmarks/compendium_runs.json``, the last run of each label): ``make reproduce`` from the
   committed measurement records, a rebuild of the default records from scratch, ``make test`` with its
   audit.

Timing: the compared methods are interleaved batch by batch (order rotated each batch) so that
load from other processes hits them alike; one warm-up batch per method first; ratios are medians
of the paired per-batch ratios, pass times medians over repetitions. Memory: peak RSS (VmHWM,
reset through /proc/self/clear_refs after loading) minus RSS after loading; on CUDA also the peak
of torch's allocator over what the loaded model holds.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The sizes the benchmark is specified at; the report names every deviation from them.
TARGET_SIZES = {"prompts": 256, "tokens": 52, "batch_size": 32, "scaling": [64, 256, 1024],
               "gen_prompts": 64, "gen_tokens": 20}
TARGETS = {
    1: "lib / bare forward <= 1.05x",
    2: "lib no slower than TransformerLens; lib extra memory <= 1/4 of TransformerLens'",
    3: "batched / per-prompt loop >= 10x tokens per second",
    4: "time per prompt flat (linear time); extra memory flat",
    5: "make reproduce from committed records <= 10 min on 2 cores; make test with its audit <= 20 min",
}
COMPENDIUM_RUNS = ROOT / "benchmarks" / "compendium_runs.json"  # item 5: one timed run per label (the last)
# item 5's targets, by label (seconds); a label without one is reported, not decided
RUN_TARGETS = {"make reproduce (committed records)": 600, "make test (with the audit)": 1200}
LINEAR_TOL = 1.25  # item 4: largest / smallest time per prompt (and extra memory) still counted as flat
FLAT_MEM_SLACK_MIB = 64.0  # item 4: memory differences below this are noise of the allocator
MARK = "BENCH_JSON "


# ----------------------------------------------------------------------------- machine and memory


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _status_kib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def rss_mib() -> float:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib / 1024
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class PeakRSS:
    """Peak resident memory of this process from ``start()`` on.

    Linux: reset the kernel's high-water mark (write 5 to /proc/self/clear_refs) and read VmHWM;
    elsewhere a thread samples RSS every few milliseconds (may miss very short peaks)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.method = ""
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PeakRSS":
        try:
            Path("/proc/self/clear_refs").write_text("5")
            if _status_kib("VmHWM") is None:
                raise OSError("no VmHWM")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = f"RSS sampled every {self.interval * 1000:.0f} ms"
            self._peak = rss_mib()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_mib())

    def peak(self) -> float:
        if self._thread is None:
            return _status_kib("VmHWM") / 1024
        self._stop.set()
        self._thread.join()
        return max(self._peak, rss_mib())


# ----------------------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (median(xs), median(xs))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return float(q[0]), float(q[2])


def paired_ratios(num: list[list[float]], den: list[list[float]]) -> list[float]:
    """Per-batch ratios num/den for batches timed side by side ([rep][batch] each)."""
    return [a / b for ra, rb in zip(num, den) for a, b in zip(ra, rb)]


def rotations(names: Sequence[str], i: int) -> list[str]:
    """The method order for batch ``i``: rotated by one each batch (A B C, B C A, C A B, ...)."""
    k = i % len(names)
    return list(names[k:]) + list(names[:k])


def interleave(methods: dict[str, Callable], chunks: Sequence, reps: int, warmup: int = 1,
               sync: Callable[[], None] = lambda: None, log: Callable[[str], None] = lambda s: None) -> dict:
    """Time each method on each chunk, interleaved chunk by chunk: {name: [[seconds per chunk] per rep]}.

    ``warmup`` chunks per method run first and are not counted."""
    names = list(methods)
    for w in range(min(warmup, len(chunks))):
        for name in names:
            methods[name](chunks[w])
    sync()
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    step = 0
    for r in range(reps):
        for n in names:
            out[n].append([])
        for i, chunk in enumerate(chunks):
            for name in rotations(names, step):
                sync()
                t0 = time.perf_counter()
                methods[name](chunk)
                sync()
                out[name][-1].append(time.perf_counter() - t0)
            step += 1
        log(f"  rep {r + 1}/{reps}: " + ", ".join(f"{n} {sum(out[n][-1]):.1f}s" for n in names)
            + f" (load {load_avg()[:1]})")
    return out


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


# ----------------------------------------------------------------------------- inputs


def fixed_length_texts(tokenizer, n: int, length: int, texts: Sequence[str] | None = None) -> list[str]:
    """``n`` texts that tokenise to at least ``length`` tokens (cut to exactly ``length`` by
    ``max_length``): wiki_samples prompts by default, cycled if there are too few."""
    if texts is None:
        from lib import data

        texts = [r["prompt"] for r in data.wiki_samples()]
    long_enough = [t for t in texts if len(tokenizer(t)["input_ids"]) >= length]
    if not long_enough:
        raise ValueError(f"no text has {length} tokens")
    return [long_enough[i % len(long_enough)] for i in range(n)]


def chunked(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]


# ----------------------------------------------------------------------------- the methods


class Methods:
    """The compared computations on one loaded model (and, for TransformerLens, its own copy)."""

    def __init__(self, loaded, tokens: int, batch_size: int):
        import torch

        self.torch = torch
        self.loaded = loaded
        self.tokens = tokens
        self.batch_size = batch_size
        self.bridge = None
        self.device = str(loaded.model.device)

    def sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def encode(self, texts):
        from lib import hooks

        enc = hooks.encode(self.loaded, texts, self.tokens)
        return enc

    def bare(self, texts):
        """Tokenise and run the model, logits for the last position only (what pass 1 costs without hooks)."""
        import inspect

        model = self.loaded.model
        kw = {"logits_to_keep": 1, "use_cache": False} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with self.torch.inference_mode():
            for chunk in chunked(list(texts), self.batch_size):
                model(**self.encode(chunk), **kw)

    def lib(self, texts, **kw):
        from lib import hooks

        return hooks.mlp_activation_stats(self.loaded, list(texts), positions="all", batch_size=self.batch_size,
                                          max_length=self.tokens, progress=False, **kw)

    def tl_setup(self, tl_loaded):
        from lib import models

        self.tl_loaded = tl_loaded
        self.bridge = models.bridge(tl_loaded)
        n = tl_loaded.info.n_layers
        self.tl_names = [f"blocks.{L}.mlp.hook_post" for L in range(n)]

    def tl(self, texts):
        """TransformerLens 4: run_with_cache on every layer's mlp.hook_post, then a masked mean."""
        from lib import hooks

        torch = self.torch
        n, d = self.tl_loaded.info.n_layers, self.tl_loaded.info.d_mlp
        total = torch.zeros(n, d, dtype=torch.float64)
        count = 0.0
        with torch.inference_mode():
            for chunk in chunked(list(texts), self.batch_size):
                enc = hooks.encode(self.tl_loaded, chunk, self.tokens)
                _, cache = self.bridge.run_with_cache(enc["input_ids"], attention_mask=enc["attention_mask"],
                                                      names_filter=self.tl_names)
                m = enc["attention_mask"].float()
                acts = torch.stack([cache[name] for name in self.tl_names])  # [layers, batch, pos, d_mlp]
                total += torch.einsum("bp,lbpd->ld", m, acts.float()).double().cpu()
                count += float(m.sum())
                del cache, acts
        return (total / max(count, 1.0)).float()


def loop_generate(loaded, prompts, max_new_tokens: int, max_prompt_tokens: int) -> list[list[int]]:
    """The baseline: one ``model.generate`` call per prompt (greedy, KV cache, no padding)."""
    import torch

    tok, model = loaded.tokenizer, loaded.model
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, add_special_tokens=True)["input_ids"][:max_prompt_tokens]
            x = torch.tensor([ids], device=model.device)
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)
            row = y[0, len(ids):].tolist()
            out.append(row[:next((j for j, t in enumerate(row) if t in eos), len(row))])
    return out


# ----------------------------------------------------------------------------- worker (fresh subprocess)


def setup_torch(threads: int):
    import torch

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return torch


def touch_weights(model) -> None:
    """Read every parameter and buffer once, so that memory-mapped weights are resident."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel():
            t.detach().reshape(-1)[:: max(1, 1024 // t.element_size())].sum()


def load_model(args):
    from lib import models

    return models.load(args.model, device=args.device, dtype=args.dtype)


def worker(args) -> dict:
    """One method on ``n`` prompts in this (fresh) process: extra peak memory and pass time."""
    torch = setup_torch(args.threads)
    loaded = load_model(args)
    m = Methods(loaded, args.tokens, args.batch_size)
    texts = fixed_length_texts(loaded.tokenizer, args.n, args.tokens)
    gc.collect()
    rss_loaded = rss_mib()
    touch_weights(loaded.model)  # weights may be memory-mapped: page them in before the baseline
    gc.collect()
    rss_model = rss_mib()
    if args.method == "tl":
        tl_loaded = loaded
        m.tl_setup(tl_loaded)  # the bridge wraps this model's modules in place
        gc.collect()
    fn = {"bare": m.bare, "lib": m.lib, "tl": m.tl}[args.method]
    cuda = m.device.startswith("cuda")
    gc.collect()
    rss0 = rss_mib()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated() / 2**20
    peak = PeakRSS().start()
    load0 = load_avg()
    fn(texts[:args.batch_size])  # warm-up batch, inside the measured peak
    m.sync()
    times = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        fn(texts)
        m.sync()
        times.append(time.perf_counter() - t0)
    rec = {"method": args.method, "n": args.n, "rss_loaded_mib": round(rss_loaded, 1), "rss_model_mib": round(rss_model, 1), "rss_start_mib": round(rss0, 1),
           "peak_mib": round(peak.peak(), 1), "peak_method": peak.method, "times_s": [round(t, 3) for t in times],
           "load_start": load0, "load_end": load_avg()}
    rec["extra_peak_mib"] = round(rec["peak_mib"] - rss0, 1)
    rec["bridge_mib"] = round(rss0 - rss_model, 1)
    if cuda:
        rec["gpu_extra_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20 - gpu0, 1)
    return rec


def run_worker(args, method: str, n: int, passes: int, log) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--method", method, "--n", str(n),
           "--passes", str(passes), "--model", args.model, "--device", args.device, "--dtype", args.dtype,
           "--threads", str(args.threads), "--tokens", str(args.tokens), "--batch-size", str(args.batch_size)]
    log(f"  subprocess: {method} on {n} prompts")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {method} n={n} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rec = json.loads(lines[-1][len(MARK):])
    log(f"    extra peak {rec['extra_peak_mib']} MiB, pass {rec['times_s']} s")
    return rec


# ----------------------------------------------------------------------------- item 5


def time_command(label: str, command: Sequence[str], note: str = "", runs: Path = COMPENDIUM_RUNS) -> dict:
    """Run ``command`` in the repository, time it as a whole and keep the run under ``label`` in ``runs``
    (replacing that label's earlier run): seconds, exit code, CPU, cores, date, the command and ``note``."""
    t0 = time.perf_counter()
    rc = subprocess.run(list(command), cwd=ROOT).returncode
    rec = {"label": label, "command": " ".join(command), "seconds": round(time.perf_counter() - t0, 1), "exit_code": rc,
           "cpu": cpu_model(), "cores": os.cpu_count(), "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "note": note}
    return keep_run(rec, runs)


def keep_run(rec: dict, runs: Path = COMPENDIUM_RUNS) -> dict:
    """Add one timed run to ``runs`` (a JSON list), replacing the earlier run of its label."""
    for k in ("label", "command", "seconds", "exit_code", "cpu", "cores", "date"):
        if k not in rec:
            raise ValueError(f"a timed run needs {k!r}")
    old = json.loads(runs.read_text()) if runs.exists() else []
    new = [r for r in old if r["label"] != rec["label"]] + [rec]
    runs.write_text(json.dumps(new, indent=1) + "\n")
    return rec


def compendium_runs(runs: Path = COMPENDIUM_RUNS) -> list[dict]:
    return json.loads(runs.read_text()) if runs.exists() else []


# ----------------------------------------------------------------------------- the run


def run_all(args) -> dict:
    def log(s):
        print(s, flush=True)

    res: dict = {"args": {k: v for k, v in vars(args).items() if k != "cmd"}, "items": {}}
    torch = setup_torch(args.threads)
    import importlib.metadata

    import transformers

    res["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                      "transformers": transformers.__version__,
                      "transformer_lens": importlib.metadata.version("transformer-lens"),
                      "python": platform.python_version(), "threads": torch.get_num_threads(),
                      "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M %Z").strip(), "load_start": load_avg()}
    if args.device.startswith("cuda"):
        res["machine"]["gpu"] = torch.cuda.get_device_name(0)
    items = set(args.items)
    t_start = time.perf_counter()

    if items & {1, 2, 3}:
        loaded = load_model(args)
        m = Methods(loaded, args.tokens, args.batch_size)
        texts = fixed_length_texts(loaded.tokenizer, args.prompts, args.tokens)
        enc = m.encode(texts[:args.batch_size])
        res["inputs"] = {"prompt_shape": list(enc["input_ids"].shape),
                         "padding_tokens": int((enc["attention_mask"] == 0).sum())}

    if items & {1, 2}:
        methods = {"bare": m.bare, "lib": m.lib}
        if 2 in items:
            m.tl_setup(load_model(args))  # its own copy: the bridge wraps modules in place
            methods["tl"] = m.tl
        log(f"items 1-2: {', '.join(methods)} interleaved per batch on {len(texts)} prompts x {args.tokens} tokens, "
            f"batch {args.batch_size}, {args.reps} reps")
        chunks = chunked(texts, args.batch_size)
        times = interleave(methods, chunks, args.reps, sync=m.sync, log=log)
        r = {"times": times, "pass_s": {k: median([sum(x) for x in v]) for k, v in times.items()}}
        r["lib_over_bare"] = paired_ratios(times["lib"], times["bare"])
        if "tl" in times:
            r["lib_over_tl"] = paired_ratios(times["lib"], times["tl"])
            r["tl_over_bare"] = paired_ratios(times["tl"], times["bare"])
            a = m.lib(chunks[0]).mean
            b = m.tl(chunks[0])
            r["max_abs_diff_lib_tl"] = float((a - b).abs().max())
        res["items"]["1-2"] = r

    if 3 in items and loaded.info.is_causal:
        from lib import metrics

        gp = fixed_length_texts(loaded.tokenizer, args.gen_prompts, 1)  # the wiki prompts, cut to 32 tokens below
        got: dict[str, list] = {"batched": [], "loop": []}

        def batched(chunk):
            got["batched"].append(metrics.generate(loaded, chunk, max_new_tokens=args.gen_tokens,
                                                   batch_size=args.gen_batch_size, max_prompt_tokens=args.gen_prompt_tokens,
                                                   progress=False).new_ids)

        def loop(chunk):
            got["loop"].append(loop_generate(loaded, chunk, args.gen_tokens, args.gen_prompt_tokens))

        log(f"item 3: batched vs per-prompt generation, {len(gp)} prompts x {args.gen_tokens} new tokens, "
            f"batch {args.gen_batch_size}, {args.gen_reps} reps")
        chunks = chunked(gp, args.gen_batch_size)
        batched(gp[:2]), loop(gp[:2])  # warm-up on two prompts, not counted
        got = {"batched": [], "loop": []}
        times = interleave({"batched": batched, "loop": loop}, chunks, args.gen_reps, warmup=0, sync=m.sync, log=log)
        nb = len(chunks)
        # tokens generated (up to EOS) in the last repetition's outputs of each method
        tok_b = sum(len(x) for ids in got["batched"][-nb:] for x in ids)
        tok_l = sum(len(x) for ids in got["loop"][-nb:] for x in ids)
        same = sum(a == b for ib, il in zip(got["batched"][-nb:], got["loop"][-nb:]) for a, b in zip(ib, il))
        r = {"times": times, "pass_s": {k: median([sum(x) for x in v]) for k, v in times.items()},
             "tokens": {"batched": tok_b, "loop": tok_l}, "identical_continuations": same, "n_prompts": len(gp)}
        r["tok_per_s"] = {"batched": tok_b / r["pass_s"]["batched"], "loop": tok_l / r["pass_s"]["loop"]}
        r["speedup_paired"] = [(tok_b / nb / a) / (tok_l / nb / b) for ra, rb in zip(times["batched"], times["loop"])
                               for a, b in zip(ra, rb)]  # per-batch ratio of times, scaled by token counts
        if args.gen_other_batch and args.gen_other_batch != args.gen_batch_size:
            big, out = [], None
            for _ in range(args.gen_reps):
                m.sync()
                t0 = time.perf_counter()
                out = metrics.generate(loaded, gp, max_new_tokens=args.gen_tokens, batch_size=args.gen_other_batch,
                                       max_prompt_tokens=args.gen_prompt_tokens, progress=False).new_ids
                m.sync()
                big.append(time.perf_counter() - t0)
            r["other_batch"] = {"batch_size": args.gen_other_batch, "times": big, "tokens": sum(map(len, out)),
                              "tok_per_s": sum(map(len, out)) / median(big)}
        pre = []
        for _ in range(args.gen_reps):  # reading the prompts alone (one new token): what batching cannot remove
            m.sync()
            t0 = time.perf_counter()
            metrics.generate(loaded, gp, max_new_tokens=1, batch_size=args.gen_batch_size,
                             max_prompt_tokens=args.gen_prompt_tokens, progress=False)
            m.sync()
            pre.append(time.perf_counter() - t0)
        r["prefill_s"] = pre
        log(f"  batches of {args.gen_other_batch}: {[round(x, 1) for x in r.get('other_batch', {}).get('times', [])]} s; "
            f"prompts alone: {[round(x, 1) for x in pre]} s")
        res["items"]["3"] = r

    if args.thread_check and items & {1, 2, 3}:
        thr = sorted(set(args.thread_options))
        fwd = {f"{t}": (lambda chunk, t=t: (torch.set_num_threads(t), m.bare(chunk))) for t in thr}
        log(f"threads: one bare forward batch and a short per-prompt generation at {thr} threads, interleaved")
        batch = texts[:args.batch_size]
        tf_ = interleave(fwd, [batch] * args.thread_reps, 1, sync=m.sync, log=log)
        gen = {f"{t}": (lambda chunk, t=t: (torch.set_num_threads(t), loop_generate(loaded, chunk, 8, args.gen_prompt_tokens)))
               for t in thr} if loaded.info.is_causal else {}
        tg = interleave(gen, [texts[:2]] * args.thread_reps, 1, sync=m.sync, log=log) if gen else {}
        torch.set_num_threads(args.threads)
        res["items"]["threads"] = {"forward": {k: v[0] for k, v in tf_.items()}, "generate": {k: v[0] for k, v in tg.items()},
                                   "forward_tokens": len(batch) * args.tokens, "generate_tokens": 2 * 8}

    if items & {1, 2, 3}:
        del m, loaded
        gc.collect()

    if items & {2, 4}:
        mem = {}
        if 2 in items:
            log("item 2 memory: fresh subprocess per method")
            for meth in ("bare", "lib", "tl"):
                mem[f"{meth}@{args.mem_prompts}"] = run_worker(args, meth, args.mem_prompts, 1, log)
        if 4 in items:
            log("item 4 scaling: lib pass in a fresh subprocess per size")
            for n in args.scaling:
                key = f"lib@{n}"
                if key not in mem:
                    mem[key] = run_worker(args, "lib", n, 1, log)
        res["items"]["memory"] = mem

    if 5 in items:
        res["items"]["5"] = {"runs": compendium_runs()}

    res["machine"]["load_end"] = load_avg()
    res["machine"]["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    return res


# ----------------------------------------------------------------------------- report


def fmt_s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def ratio_cell(xs: Sequence[float]) -> str:
    lo, hi = quartiles(xs)
    return f"{median(xs):.3f}x (IQR {lo:.3f}-{hi:.3f}, n={len(xs)})"


def deviations(args) -> list[str]:
    out = []
    for k, v in TARGET_SIZES.items():
        got = getattr(args, k)
        if list(got) != v if isinstance(v, list) else got != v:
            out.append(f"`{k}` = {got} (specified: {v})")
    if getattr(args, "reps", 3) < 3:
        out.append(f"`reps` = {args.reps} (one pass over all prompts per repetition; each ratio is still the median of "
                   f"{-(-args.prompts // args.batch_size) * args.reps} paired batches)")
    if getattr(args, "mem_prompts", None) and args.mem_prompts != args.prompts:
        out.append(f"item 2's memory subprocesses ran {args.mem_prompts} prompts (the peak is per batch; item 4 has lib at "
                   "every size)")
    if getattr(args, "threads", 2) != 2:
        out.append(f"torch threads = {args.threads} (`lib.infra.repro.setup` default: 2; see the thread table at the end)")
    return out


def report(res: dict, command: str) -> str:
    a, mc, items = res["args"], res["machine"], res["items"]
    L = ["# Benchmarks", "",
         f"Produced by `{command}` ({mc['bench_seconds'] / 60:.1f} min). Absolute times depend on the machine and "
         "on what else runs on it; compare the ratios.", "",
         "| machine | |", "|---|---|",
         f"| CPU | {mc['cpu']} |", f"| cores | {mc['cores']} (torch threads: {mc['threads']}) |"]
    if "gpu" in mc:
        L.append(f"| GPU | {mc['gpu']} |")
    L += [f"| torch / transformers / transformer_lens | {mc['torch']} / {mc['transformers']} / {mc['transformer_lens']} |",
          f"| python | {mc['python']} |", f"| date | {mc['date']} |",
          f"| load average (1, 5, 15 min) at start | {', '.join(map(str, mc['load_start']))} |",
          f"| load average at end | {', '.join(map(str, mc['load_end']))} |",
          f"| model / device / dtype | {a['model']} / {a['device']} / {a['dtype']} |", ""]
    dev = deviations(argparse.Namespace(**a))
    if dev:
        L += ["Settings that differ from the benchmark's target sizes or the compendium's defaults: " + "; ".join(dev) + ".", ""]
    load = mc["load_start"][:1] + mc["load_end"][:1]
    if load and max(load) > (mc["cores"] or 1):
        L += [f"**Measured under load**: the 1-minute load average was {load[0]} at the start and {load[-1]} at the "
              f"end on {mc['cores']} cores, so other processes shared the CPU; interleaving the compared methods "
              "batch by batch spreads that load over both, but absolute times are inflated and ratios noisier.", ""]

    summary = []
    r12 = items.get("1-2")
    mem = items.get("memory", {})
    if r12:
        ratio = median(r12["lib_over_bare"])
        summary.append((1, f"lib / bare = {ratio:.3f}x", ratio <= 1.05))
        L += ["## 1-2. MLP activation statistics: lib vs bare forward vs TransformerLens", "",
              f"{a['prompts']} prompts x {a['tokens']} tokens (wiki_samples prompts, cut to exactly {a['tokens']} tokens, "
              f"no padding), batches of {a['batch_size']}, all layers, positions 'all'; {a['reps']} repetition(s) after one "
              "warm-up batch per method, methods interleaved batch by batch.", "",
              "| method | median pass time | per prompt |", "|---|---|---|"]
        names = {"bare": "bare forward (`logits_to_keep=1`)", "lib": "lib `mlp_activation_stats`",
                 "tl": "TransformerLens 4 `run_with_cache(names_filter=blocks.L.mlp.hook_post)` + mean"}
        for k, t in r12["pass_s"].items():
            L.append(f"| {names[k]} | {fmt_s(t)} | {1000 * t / a['prompts']:.1f} ms |")
        L += ["", "| ratio (median of paired per-batch ratios) | value | target | verdict |", "|---|---|---|---|",
              f"| lib / bare | {ratio_cell(r12['lib_over_bare'])} | <= 1.05x | {verdict(ratio <= 1.05)} |"]
        if "lib_over_tl" in r12:
            rt = median(r12["lib_over_tl"])
            L += [f"| lib / TransformerLens | {ratio_cell(r12['lib_over_tl'])} | <= 1.00x | {verdict(rt <= 1.0)} |",
                  f"| TransformerLens / bare | {ratio_cell(r12['tl_over_bare'])} | (anchor: ~1x) | |", "",
                  f"lib's and TransformerLens' means agree to {r12['max_abs_diff_lib_tl']:.2e} (max abs difference, first batch).",
                  "", "The hook: in transformer_lens 4.x the bridge's gated MLP (`GatedMLPBridge`) aliases `hook_post` to "
                  "`out.hook_in`, the input of `down_proj`, which is lib's hook point (lib reads it with a forward pre-hook on "
                  "`down_proj`). `run_with_cache` runs the bridge's full forward, so it also computes logits for every position; "
                  "lib and the bare forward compute them for the last position only."]
            summary.append((2, f"time lib / TL = {rt:.3f}x", rt <= 1.0))
        L.append("")
    if any(k.split("@")[0] in ("bare", "tl") for k in mem):
        n = a["mem_prompts"]
        L += [f"### 2. Extra peak memory ({n} prompts, batch {a['batch_size']}, each method in a fresh subprocess)", "",
              "Peak RSS during the warm-up batch and one pass, minus RSS after loading (for TransformerLens: after "
              "loading and building the bridge).", "",
              "| method | RSS after loading | extra peak | pass time |" + (" extra GPU peak |" if a["device"].startswith("cuda") else ""),
              "|---|---|---|---|" + ("---|" if a["device"].startswith("cuda") else "")]
        for meth in ("bare", "lib", "tl"):
            rec = mem.get(f"{meth}@{n}")
            if rec:
                L.append(f"| {meth} | {rec['rss_start_mib']:.0f} MiB | {rec['extra_peak_mib']:.0f} MiB | {fmt_s(rec['times_s'][0])} |"
                         + (f" {rec['gpu_extra_peak_mib']:.0f} MiB |" if "gpu_extra_peak_mib" in rec else ""))
        lib, tl = mem.get(f"lib@{n}"), mem.get(f"tl@{n}")
        if lib and tl:
            q = lib["extra_peak_mib"] / tl["extra_peak_mib"] if tl["extra_peak_mib"] > 0 else float("nan")
            ok = lib["extra_peak_mib"] <= 0.25 * tl["extra_peak_mib"]
            L += ["", f"lib's extra memory is {q:.3f} of TransformerLens' (target <= 0.25): {verdict(ok)}. "
                  f"Building the bridge itself added {tl['bridge_mib']:.0f} MiB. Peak measured by {lib['peak_method']}."]
            summary.append((2, f"memory lib / TL = {q:.3f}", ok))
        L.append("")
    r3 = items.get("3")
    if r3:
        sp = median(r3["speedup_paired"])
        L += ["## 3. Greedy generation: batched (lib) vs per-prompt loop", "",
              f"{r3['n_prompts']} wiki_samples prompts (first {a['gen_prompt_tokens']} tokens), {a['gen_tokens']} new tokens, "
              f"`lib.metrics.generate` with batch {a['gen_batch_size']} (left padding, KV cache) vs one `model.generate` per "
              f"prompt; {a['gen_reps']} repetition(s), interleaved batch by batch. Tokens counted up to EOS.", "",
              "| method | median time | tokens | tokens/s |", "|---|---|---|---|"]
        for k in ("batched", "loop"):
            L.append(f"| {k} | {fmt_s(r3['pass_s'][k])} | {r3['tokens'][k]} | {r3['tok_per_s'][k]:.1f} |")
        L += ["", f"Speed-up (median of paired per-batch ratios): {ratio_cell(r3['speedup_paired'])}; target >= 10x: "
              f"{verdict(sp >= 10)}. Identical continuations: {r3['identical_continuations']} of {r3['n_prompts']}.", ""]
        summary.append((3, f"batch {a['gen_batch_size']} / loop = {sp:.1f}x", sp >= 10))
        if "prefill_s" in r3:
            pf = median(r3["prefill_s"])
            L += [f"Reading the prompts alone (`max_new_tokens=1`, batch {a['gen_batch_size']}) takes {fmt_s(pf)}: even with "
                  f"free decoding, batching could not beat the loop by more than {r3['pass_s']['loop'] / pf:.1f}x here "
                  "(the prompt tokens cost the same compute either way).", ""]
        if "other_batch" in r3:
            bb = r3["other_batch"]
            q = bb["tok_per_s"] / r3["tok_per_s"]["loop"]
            was = " (generate's default before the batch size was raised to 64)" if bb["batch_size"] == 16 else ""
            L += [f"With batches of {bb['batch_size']}{was}, timed right after each repetition (not interleaved): median "
                  f"{fmt_s(median(bb['times']))}, {bb['tok_per_s']:.1f} tokens/s, {q:.1f}x the loop's tokens/s.", ""]
            summary.append((3, f"batch {bb['batch_size']}{was} / loop = {q:.1f}x", None))
        if sp < 10:
            L += ["Why the target is missed here: both methods read every prompt token once, and on a CPU (more so one shared "
                  "with other processes) a decoding step's cost grows with the number of sequences in the batch, so batching "
                  "saves less than where a step costs about the same for 1 or 64 sequences (a GPU, or a CPU with idle cores "
                  "whose step is dominated by reading the weights). A larger batch narrows the gap: for that reason "
                  "`lib.metrics.GENERATE_BATCH_SIZE` went from 16 to 64 (compare the rows above).", ""]
    scal = sorted(((int(k.split("@")[1]), v) for k, v in mem.items() if k.startswith("lib@") and int(k.split("@")[1]) in a["scaling"]))
    if scal:
        L += ["## 4. Scaling of pass 1 (lib) with the number of prompts", "",
              f"Fresh subprocess per size; one pass after a warm-up batch; {a['tokens']} tokens per prompt, batch {a['batch_size']}.", "",
              "| prompts | pass time | per prompt | extra peak memory | load (1 min) at start |", "|---|---|---|---|---|"]
        per = []
        for n, rec in scal:
            t = rec["times_s"][0]
            per.append(t / n)
            L.append(f"| {n} | {fmt_s(t)} | {1000 * t / n:.1f} ms | {rec['extra_peak_mib']:.0f} MiB | {rec['load_start'][0] if rec['load_start'] else '?'} |")
        ex = [rec["extra_peak_mib"] for _, rec in scal]
        lin = max(per) / min(per) <= LINEAR_TOL
        flat = max(ex) - min(ex) <= max(FLAT_MEM_SLACK_MIB, (LINEAR_TOL - 1) * min(ex))
        L += ["", f"Time per prompt varies {max(per) / min(per):.2f}x across sizes (linear if <= {LINEAR_TOL}x): {verdict(lin)}. "
              f"Extra memory ranges {min(ex):.0f}-{max(ex):.0f} MiB (flat if within {FLAT_MEM_SLACK_MIB:.0f} MiB or "
              f"{100 * (LINEAR_TOL - 1):.0f}%): {verdict(flat)}.", ""]
        summary.append((4, f"time/prompt spread {max(per) / min(per):.2f}x, memory {min(ex):.0f}-{max(ex):.0f} MiB", lin and flat))
    r5 = items.get("5")
    if r5 is not None:
        L += render_runs(r5.get("runs", []), summary)
    th = items.get("threads")
    if th:
        L += ["## Thread setting", "",
              f"The same work at different torch thread counts, interleaved ({a['thread_reps']} repetition(s)): one bare forward "
              f"batch ({a['batch_size']} x {a['tokens']} tokens) and a per-prompt greedy generation of 2 prompts x 8 new tokens. "
              f"The rest of this run used {mc['threads']} thread(s). With more runnable threads than cores (see the load "
              "average), every parallel operation waits for its slowest thread, and small operations (one-token decoding "
              "steps) suffer most; on a shared machine `COMPENDIUM_THREADS=1` (read by `lib.infra.repro.setup`) avoids that.", "",
              "| threads | forward batch (median) | tokens/s | short generation (median) | tokens/s |", "|---|---|---|---|---|"]
        for k in th["forward"]:
            tf_, tg = median(th["forward"][k]), median(th["generate"].get(k, []))
            L.append(f"| {k} | {fmt_s(tf_)} | {th['forward_tokens'] / tf_:.0f} | {fmt_s(tg)} | {th['generate_tokens'] / tg:.1f} |")
        L.append("")
    head = ["## Summary", "", "| item | target | measured | verdict |", "|---|---|---|---|"]
    head += [f"| {i} | {TARGETS[i]} | {txt} | {verdict(ok)} |" for i, txt, ok in summary]
    cut = next(i for i, line in enumerate(L) if line.startswith("## ")) if any(line.startswith("## ") for line in L) else len(L)
    return "\n".join(L[:cut] + head + [""] + L[cut:]).rstrip() + "\n"


def render_runs(runs: list[dict], summary: list) -> list[str]:
    """Item 5's section: one row per timed command (its machine and date), and the targets' verdicts."""
    L = ["## 5. The compendium's commands", "",
         "Each command timed as a whole on the machine named, with `python benchmarks/bench.py time LABEL -- COMMAND` "
         "(`benchmarks/compendium_runs.json`; the last run of each label). Targets: " + TARGETS[5] + ".", ""]
    if not runs:
        summary.append((5, "no timed run yet", None))
        return L + ["No command has been timed yet.", ""]
    L += ["| command | what | time | exit | machine | date | target |", "|---|---|---|---|---|---|---|"]
    decided = []
    for r in runs:
        target = RUN_TARGETS.get(r["label"])
        ok = None if target is None else (r["exit_code"] == 0 and r["seconds"] <= target)
        if target is not None:
            decided.append(ok)
        L.append(f"| `{r['command']}` | {r['label']}{'; ' + r['note'] if r.get('note') else ''} | {r['seconds'] / 60:.1f} min | "
                 f"{r['exit_code']} | {r['cpu']}, {r['cores']} cores | {r['date']} | "
                 f"{'<= %.0f min: %s' % (target / 60, verdict(ok)) if target is not None else 'reported'} |")
    L.append("")
    summary.append((5, "; ".join(f"{r['label']} {r['seconds'] / 60:.1f} min" for r in runs),
                    None if not decided else all(decided)))
    return L


# ----------------------------------------------------------------------------- CLI


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="run", choices=["run", "worker", "report"],
                    help="also: time LABEL [--note TEXT] -- COMMAND ... (item 5: time one of the compendium's commands)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, auto")
    ap.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("COMPENDIUM_THREADS", "2")))
    ap.add_argument("--items", default="1,2,3,4,5", help="comma-separated subset of 1-5")
    ap.add_argument("--prompts", type=int, default=TARGET_SIZES["prompts"])
    ap.add_argument("--tokens", type=int, default=TARGET_SIZES["tokens"])
    ap.add_argument("--batch-size", type=int, default=TARGET_SIZES["batch_size"])
    ap.add_argument("--mem-prompts", type=int, default=None,
                    help="prompts for item 2's memory subprocesses (default: --prompts; the peak is per batch)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of items 1-2 after the warm-up")
    ap.add_argument("--scaling", default=",".join(map(str, TARGET_SIZES["scaling"])))
    ap.add_argument("--gen-prompts", type=int, default=TARGET_SIZES["gen_prompts"])
    ap.add_argument("--gen-tokens", type=int, default=TARGET_SIZES["gen_tokens"])
    ap.add_argument("--gen-batch-size", type=int, default=None,
                    help="lib's batch in item 3 (default: lib.metrics.GENERATE_BATCH_SIZE, generate's default)")
    ap.add_argument("--gen-prompt-tokens", type=int, default=32, help="lib.metrics.generate's default")
    ap.add_argument("--gen-reps", type=int, default=3)
    ap.add_argument("--gen-other-batch", type=int, default=16,
                    help="also time lib generation with this batch size (16: generate's earlier default; 0: skip)")
    ap.add_argument("--no-thread-check", dest="thread_check", action="store_false",
                    help="skip the comparison of torch thread counts")
    ap.add_argument("--thread-options", default="1,2", help="thread counts compared by the thread check")
    ap.add_argument("--thread-reps", type=int, default=3)
    ap.add_argument("--refresh-runs", action="store_true",
                    help="with 'report': re-read item 5's timed commands instead of those stored in the raw results")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--json", default=None, help="raw results (default: next to --out, .json)")
    # worker
    ap.add_argument("--method", choices=["bare", "lib", "tl"])
    ap.add_argument("--n", type=int)
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args(argv)
    args.items = sorted({int(x) for x in str(args.items).split(",") if x.strip()})
    args.scaling = sorted({int(x) for x in str(args.scaling).split(",") if x.strip()})
    args.mem_prompts = args.mem_prompts or args.prompts
    if args.gen_batch_size is None:
        from lib.metrics import GENERATE_BATCH_SIZE

        args.gen_batch_size = GENERATE_BATCH_SIZE
    args.thread_options = sorted({int(x) for x in str(args.thread_options).split(",") if x.strip()})
    if any(i not in TARGETS for i in args.items):
        ap.error("--items takes numbers 1-5")
    if args.device != "cpu":
        from lib import models

        args.device = models.resolve_device(args.device)
    return args


def time_main(argv: list[str]) -> None:
    """``bench.py time LABEL [--note TEXT] -- COMMAND ...``: time one command for item 5."""
    if "--" not in argv:
        raise SystemExit("usage: bench.py time LABEL [--note TEXT] -- COMMAND ...")
    head, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ap = argparse.ArgumentParser(prog="bench.py time")
    ap.add_argument("label")
    ap.add_argument("--note", default="")
    a = ap.parse_args(head)
    if not command:
        raise SystemExit("usage: bench.py time LABEL [--note TEXT] -- COMMAND ...")
    rec = time_command(a.label, command, a.note)
    print(json.dumps(rec))
    raise SystemExit(rec["exit_code"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["time"]:
        time_main(argv[1:])
    args = parse(argv)
    if args.cmd == "worker":
        print(MARK + json.dumps(worker(args)), flush=True)
        return
    out = Path(args.out)
    raw = Path(args.json) if args.json else out.with_suffix(".json")
    command = "python benchmarks/bench.py " + " ".join(argv)
    if args.cmd == "report":  # re-render the markdown from the raw results
        res = json.loads(raw.read_text())
        command = res.get("command", command)
        if args.refresh_runs:  # item 5 from the timed commands as they are now
            res["items"]["5"] = {"runs": compendium_runs()}
            raw.write_text(json.dumps(res, indent=1) + "\n")
    else:
        res = run_all(args)
        res["command"] = command.strip()
        raw.write_text(json.dumps(res, indent=1) + "\n")
    out.write_text(report(res, res.get("command", command)))
    print(f"wrote {out} and {raw}")


if __name__ == "__main__":
    main()
