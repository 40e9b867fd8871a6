"""Helpers of benchmarks/bench.py: interleaving, ratios, inputs, memory, the TransformerLens
baseline, the runner's records and the report's verdicts (no timed assertions)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from lib import hooks, models
from lib.infra import paths

_spec = importlib.util.spec_from_file_location("bench", paths.ROOT / "benchmarks" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_rotations_put_each_method_first_in_turn():
    assert [bench.rotations("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_interleave_runs_every_method_on_every_chunk_in_rotated_order():
    calls = []
    methods = {name: (lambda chunk, name=name: calls.append((name, chunk))) for name in ("a", "b")}
    out = bench.interleave(methods, [1, 2, 3], reps=2, warmup=1)
    assert calls[:2] == [("a", 1), ("b", 1)]  # warm-up, not timed
    timed = calls[2:]
    assert len(timed) == 2 * 3 * 2
    assert timed[:4] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert {k: [len(r) for r in v] for k, v in out.items()} == {"a": [3, 3], "b": [3, 3]}
    assert all(t >= 0 for v in out.values() for r in v for t in r)


def test_paired_ratios_and_quartiles():
    assert bench.paired_ratios([[2.0, 3.0], [4.0]], [[1.0, 3.0], [8.0]]) == [2.0, 1.0, 0.5]
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)


def test_fixed_length_texts_give_exactly_length_tokens_without_padding(tmp_path):
    lm = models.tiny_random("llama")
    src = ["short", "a much longer sentence with quite a few words in it for sure", "one two three four five six"]
    texts = bench.fixed_length_texts(lm.tokenizer, 5, 6, src)
    assert len(texts) == 5 and "short" not in texts
    enc = hooks.encode(lm, texts, 6)
    assert tuple(enc["input_ids"].shape) == (5, 6)
    assert int(enc["attention_mask"].sum()) == 30
    with pytest.raises(ValueError):
        bench.fixed_length_texts(lm.tokenizer, 2, 500, src)


def test_peak_rss_sees_an_allocation():
    peak = bench.PeakRSS().start()
    start = bench.rss_mib()
    block = bytearray(64 * 2**20)  # touched pages: 64 MiB resident
    block[::4096] = b"x" * len(block[::4096])
    assert peak.peak() - start > 48
    del block


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformer_lens_baseline_computes_the_lib_mean(family, tmp_path):
    lm = models.tiny_random(family, folder=tmp_path / "a")
    tl = models.tiny_random(family, folder=tmp_path / "b")
    m = bench.Methods(lm, tokens=8, batch_size=2)
    m.tl_setup(tl)
    texts = ["the cat sat on the mat today", "a b", "hello there my friend how are you"]
    torch.testing.assert_close(m.tl(texts), m.lib(texts).mean, atol=1e-5, rtol=1e-4)
    m.bare(texts)  # runs


def test_bfloat16_path_runs_and_agrees(tmp_path):
    lm = models.tiny_random("llama", folder=tmp_path / "a")
    tl = models.tiny_random("llama", folder=tmp_path / "b")
    for x in (lm, tl):
        x.model.to(torch.bfloat16)
    m = bench.Methods(lm, tokens=8, batch_size=2)
    m.tl_setup(tl)
    texts = ["the cat sat on the mat today", "hello there my friend how are you"]
    torch.testing.assert_close(m.tl(texts), m.lib(texts).mean, atol=2e-2, rtol=2e-2)
    m.bare(texts)


def test_loop_generate_matches_batched_generation_greedy():
    from lib import metrics

    lm = models.tiny_random("llama")
    prompts = ["the cat sat", "hello there my good friend"]
    loop = bench.loop_generate(lm, prompts, max_new_tokens=4, max_prompt_tokens=8)
    batched = metrics.generate(lm, prompts, max_new_tokens=4, batch_size=2, max_prompt_tokens=8, progress=False)
    assert loop == batched.new_ids


def test_timed_commands_keep_the_last_run_of_each_label(tmp_path):
    """Item 5: ``bench.py time`` runs a command, keeps its wall time, exit code and machine, one run per label."""
    runs = tmp_path / "runs.json"
    a = bench.time_command("ok", ["true"], runs=runs)
    b = bench.time_command("fails", ["false"], note="a note", runs=runs)
    assert a["exit_code"] == 0 and b["exit_code"] == 1 and b["note"] == "a note" and a["seconds"] >= 0
    bench.time_command("ok", ["true"], note="again", runs=runs)
    kept = bench.compendium_runs(runs)
    assert [r["label"] for r in kept] == ["fails", "ok"] and kept[1]["note"] == "again"
    with pytest.raises(ValueError, match="needs 'seconds'"):
        bench.keep_run({"label": "x", "command": "y"}, runs)
    with pytest.raises(SystemExit, match="usage: bench.py time"):
        bench.main(["time", "a label", "true"])  # no '--' before the command


def _fake_results(lib_over_bare, lib_extra, tl_extra, speedup, per_prompt, mems, seconds):
    args = vars(bench.parse(["--out", "/dev/null"]))
    args.pop("cmd")
    mem = {"lib@256": {"rss_start_mib": 500, "extra_peak_mib": lib_extra, "times_s": [per_prompt[0] * 256], "peak_method": "x",
                       "bridge_mib": 0, "load_start": [1.0]},
           "tl@256": {"rss_start_mib": 530, "extra_peak_mib": tl_extra, "times_s": [10.0], "peak_method": "x",
                      "bridge_mib": 30, "load_start": [1.0]}}
    for n, t, x in zip((64, 1024), per_prompt, mems):
        mem[f"lib@{n}"] = {"rss_start_mib": 500, "extra_peak_mib": x, "times_s": [t * n], "peak_method": "x",
                           "bridge_mib": 0, "load_start": [1.0]}
    return {"args": args, "command": "bench", "machine": {
        "cpu": "cpu", "cores": 2, "threads": 2, "torch": "t", "transformers": "t", "transformer_lens": "t",
        "python": "3", "date": "d", "load_start": [1.0, 1.0, 1.0], "load_end": [1.0, 1.0, 1.0], "bench_seconds": 60},
        "items": {"1-2": {"pass_s": {"bare": 1.0, "lib": lib_over_bare, "tl": 1.0}, "lib_over_bare": [lib_over_bare] * 3,
                          "lib_over_tl": [lib_over_bare - 0.05] * 3, "tl_over_bare": [1.0] * 3, "max_abs_diff_lib_tl": 0.0},
                  "3": {"pass_s": {"batched": 1.0, "loop": speedup}, "tokens": {"batched": 10, "loop": 10},
                        "tok_per_s": {"batched": 10.0, "loop": 10.0 / speedup}, "speedup_paired": [speedup] * 2,
                        "identical_continuations": 4, "n_prompts": 4},
                  "memory": mem,
                  "5": {"runs": [{"label": label, "command": "make", "seconds": seconds, "exit_code": 0, "cpu": "cpu",
                                  "cores": 2, "date": "d"} for label in bench.RUN_TARGETS]}}}


def _verdicts(md: str) -> list[str]:
    summary = md.split("## Summary")[1].split("##")[0]
    return [line.split("|")[-2].strip() for line in summary.splitlines() if line.startswith("| ") and line[2].isdigit()]


def test_report_marks_met_targets():
    md = bench.report(_fake_results(1.01, 50, 900, 12.0, (0.010, 0.0105), (50, 60), 600), "bench")
    assert _verdicts(md) == ["**met**"] * 6


def test_report_marks_missed_targets():
    md = bench.report(_fake_results(1.2, 400, 900, 3.0, (0.010, 0.02), (50, 400), 4000), "bench")
    assert _verdicts(md) == ["**missed**"] * 6
