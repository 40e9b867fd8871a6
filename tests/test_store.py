"""lib.infra.store: records keyed by step, parameters, data and method version; strict mode; the audit."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest
import torch

from lib import models
from lib.infra import store
from lib.papers import dpo


@pytest.fixture
def toy_step():
    """A step whose build counts its calls; a tolerance of 0.1 on its 'value'."""
    def compare(c, f):
        return [store.within("value", c["value"], f["value"], 0.1, "a stated 0.1")]

    saved = dict(store.STEPS)
    store.step("toy", 3, "a test step", compare)
    yield
    store.STEPS.clear()
    store.STEPS.update(saved)


def counted(value=1.0):
    calls = []

    def build():
        calls.append(1)
        return {"value": value, "array": np.arange(200, dtype=np.float32) / 7, "texts": ["a", "b"]}

    return build, calls


def test_codec_is_exact():
    """Arrays and tensors (any dtype, long ones as bytes), frames with attrs, tuples and non-text keys come back equal."""
    frame = pd.DataFrame({"a": [1, 2], "b": ["x", "y"], "c": [0.1, np.nan]}, index=pd.Index(["r", "s"], name="row"))
    frame.attrs["n"] = 3
    obj = {"f32": np.random.default_rng(0).normal(size=(3, 100)).astype(np.float32),
           "t": torch.randn(70, generator=torch.Generator().manual_seed(0)), "bf": torch.ones(80, dtype=torch.bfloat16),
           "small": np.array([1, 2, 3]), "frame": frame, "tup": (1, "a"), "keys": {1: "one", (2, 3): "pair"},
           "nan": float("nan"), "s": pd.Series([1.5, 2.5], index=["a", "b"], name="v")}
    back = store.decode(json.loads(json.dumps(store.encode(obj))))
    np.testing.assert_array_equal(back["f32"], obj["f32"])
    assert back["f32"].dtype == np.float32
    assert torch.equal(back["t"], obj["t"]) and torch.equal(back["bf"], obj["bf"])
    pd.testing.assert_frame_equal(back["frame"], frame)
    assert back["frame"].attrs == {"n": 3}
    assert back["tup"] == (1, "a") and back["keys"] == {1: "one", (2, 3): "pair"} and np.isnan(back["nan"])
    pd.testing.assert_series_equal(back["s"], obj["s"])


def test_a_record_is_written_once_and_read_back(toy_step, own_store):
    build, calls = counted()
    first = store.measure("toy", "m", {"n": 2}, build, inputs=["prompt one", "prompt two"])
    again = store.measure("toy", "m", {"n": 2}, build, inputs=["prompt one", "prompt two"])
    assert len(calls) == 1
    np.testing.assert_array_equal(first["array"], again["array"])
    (path,) = (own_store / "m" / "measurements" / "toy").glob("*.json*")
    doc = store.read(path)
    assert doc["version"] == 3 and doc["params"]["n"] == 2 and len(doc["params"]["inputs"]) == 64
    prov = doc["provenance"]
    assert {"commit", "packages", "device", "cpu", "wall_s", "date", "threads"} <= set(prov)
    assert prov["packages"]["torch"] == torch.__version__


@pytest.mark.parametrize("change", ["prompt", "param", "version"])
def test_a_changed_prompt_parameter_or_method_version_is_not_reused(toy_step, change):
    build, calls = counted()
    store.measure("toy", "m", {"n": 2}, build, inputs=["prompt one", "prompt two"])
    if change == "version":
        store.step("toy", 4, "the same step, its meaning changed", store.STEPS["toy"].compare)
    inputs = ["prompt one", "prompt 2"] if change == "prompt" else ["prompt one", "prompt two"]
    store.measure("toy", "m", {"n": 3 if change == "param" else 2}, build, inputs=inputs)
    assert len(calls) == 2


def test_a_changed_fact_is_not_reused(toy_step):
    """Facts enter as data like prompts: one changed object gives another record."""
    build, calls = counted()
    facts = [{"subject": "Paris", "object": "France"}, {"subject": "Rome", "object": "Italy"}]
    store.measure("toy", "m", {}, build, inputs=facts)
    store.measure("toy", "m", {}, build, inputs=[facts[0], {"subject": "Rome", "object": "Spain"}])
    assert len(calls) == 2


def test_strict_mode_names_the_missing_record_and_the_command(toy_step, monkeypatch):
    monkeypatch.setenv(store.RECORDS_ENV, "strict")
    monkeypatch.setenv(store.NOTEBOOK_ENV, "03_toxic_neurons_explain_little")
    build, calls = counted()
    with pytest.raises(store.MissingRecord, match=r"missing record .*measurements/toy/[0-9a-f]{16}\.json.*"
                                                  r"make reproduce NOTEBOOKS=03"):
        store.measure("toy", "smollm2-135m", {"n": 2}, build)
    assert not calls  # nothing computed
    monkeypatch.setenv(store.RECORDS_ENV, "use")
    store.measure("toy", "smollm2-135m", {"n": 2}, build)
    monkeypatch.setenv(store.RECORDS_ENV, "strict")
    store.measure("toy", "smollm2-135m", {"n": 2}, build)  # present now: read
    assert len(calls) == 1


def test_fresh_mode_recomputes_and_a_bad_mode_is_one_line(toy_step, monkeypatch):
    build, calls = counted()
    store.measure("toy", "m", {}, build)
    monkeypatch.setenv(store.RECORDS_ENV, "fresh")
    store.measure("toy", "m", {}, build)
    assert len(calls) == 2
    # a rebuild measures each record once: what it wrote since it began is read by the next notebook asking
    monkeypatch.setenv(store.FRESH_SINCE_ENV, "2000-01-01T00:00:00")
    store.measure("toy", "m", {}, build)
    assert len(calls) == 2
    monkeypatch.setenv(store.FRESH_SINCE_ENV, "2999-01-01T00:00:00")
    store.measure("toy", "m", {}, build)
    assert len(calls) == 3
    monkeypatch.setenv(store.RECORDS_ENV, "sometimes")
    with pytest.raises(ValueError, match="COMPENDIUM_RECORDS must be one of use, strict, fresh"):
        store.measure("toy", "m", {}, build)


def test_measure_many_computes_only_the_missing_records_in_one_call(toy_step):
    seen = []

    def build_many(idx):
        seen.append(list(idx))
        return [{"value": float(i)} for i in idx]

    first = store.measure_many("toy", "m", [{"i": 0}, {"i": 1}], build_many)
    both = store.measure_many("toy", "m", [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}], build_many)
    assert seen == [[0, 1], [2, 3]] and [b["value"] for b in both] == [0.0, 1.0, 2.0, 3.0]
    assert first == both[:2]


def _plan_file(tmp_path, records):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"seed": "s", "budget_s": 60, "records": records}))
    return p


def test_the_audit_recomputes_a_planned_record_and_returns_the_committed_one(toy_step, tmp_path, monkeypatch):
    build, calls = counted(1.0)
    store.measure("toy", "m", {}, build)
    (rec,) = [r["record"] for r in store.inventory()]
    monkeypatch.setenv(store.AUDIT_PLAN_ENV, str(_plan_file(tmp_path, [rec])))
    monkeypatch.setenv(store.AUDIT_LOG_ENV, str(tmp_path / "audit.jsonl"))
    build2, calls2 = counted(1.05)  # within the stated 0.1
    out = store.measure("toy", "m", {}, build2)
    assert out["value"] == 1.0 and len(calls2) == 1  # recomputed, and the committed record returned
    ok, text = store.audit_report({"seed": "s", "records": [rec]}, tmp_path / "audit.jsonl")
    assert ok and "within tolerance" in text and "value: committed 1" in text


def test_a_corrupted_record_fails_the_audit_naming_it(toy_step, tmp_path, monkeypatch):
    """A record edited by hand (its value moved beyond the tolerance) fails the audit, which names it."""
    build, _ = counted(1.0)
    store.measure("toy", "m", {}, build)
    (rec,) = [r["record"] for r in store.inventory()]
    path = next((store.root() / "m" / "measurements" / "toy").glob("*.json*"))
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
    doc = json.loads(text)
    doc["data"]["value"] = 5.0  # corrupted
    blob = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(blob) if path.suffix == ".gz" else blob)
    monkeypatch.setenv(store.AUDIT_PLAN_ENV, str(_plan_file(tmp_path, [rec])))
    monkeypatch.setenv(store.AUDIT_LOG_ENV, str(tmp_path / "audit.jsonl"))
    with pytest.raises(store.AuditFailure, match=rf"{path.name}.*beyond its tolerance.*value: committed 5"):
        store.measure("toy", "m", {}, build)
    ok, report = store.audit_report({"seed": "s", "records": [rec]}, tmp_path / "audit.jsonl")
    assert not ok and f"BEYOND TOLERANCE {rec}" in report


def test_an_unreadable_record_is_one_line_naming_it(toy_step):
    build, _ = counted()
    store.measure("toy", "m", {}, build)
    path = next((store.root() / "m" / "measurements" / "toy").glob("*.json*"))
    path.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=rf"record .*{path.name} is unreadable"):
        store.measure("toy", "m", {}, build)


def test_a_planned_record_no_notebook_asked_for_fails_the_report(tmp_path):
    ok, text = store.audit_report({"seed": "s", "records": ["m/measurements/toy/abc.json"]}, tmp_path / "none.jsonl")
    assert not ok and "NOT RECOMPUTED m/measurements/toy/abc.json" in text


def test_the_plan_takes_one_record_of_each_step_and_rotates_with_the_seed(toy_step):
    store.step("toy2", 1, "another step")
    for i in range(6):
        store.measure("toy", "m", {"i": i}, lambda: {"value": 1.0})
        store.measure("toy2", "m", {"i": i}, lambda: {"value": 1.0})
    plans = [store.plan(seed, budget_s=0.0) for seed in ("a", "b", "c", "d")]
    for p in plans:
        steps = sorted(r.split("/")[-2] for r in p["records"])
        assert steps == ["toy", "toy2"]  # one of each, even with no budget left
    assert len({tuple(p["records"]) for p in plans}) > 1  # the sample rotates with the seed
    assert len(store.plan("a", budget_s=1e6)["records"]) == 12


def test_evaluation_records_are_keyed_by_the_intervention(own_store):
    """dpo.evaluate keeps one record per model, table and positions; evaluate_each shares them."""
    lm = models.tiny_random("llama", seed=0)
    kw = dict(n_prompts=2, n_wiki=2, max_new_tokens=3, scorer="profanity-check")
    table = pd.DataFrame([{"layer": 0, "neuron": 1, "mode": "set", "value": 3.0}])
    a = dpo.evaluate(lm, table, toxicity_only=True, **kw)
    b = dpo.evaluate(lm, table.assign(value=4.0), toxicity_only=True, **kw)
    recs = sorted((own_store / lm.name / "measurements" / "evaluation").glob("*.json*"))
    assert len(recs) == 2
    each = dpo.evaluate_each(lm, [table, table.assign(value=4.0), table.assign(value=5.0)], **kw)
    assert each[0] == a and each[1] == b
    assert len(sorted((own_store / lm.name / "measurements" / "evaluation").glob("*.json*"))) == 3


def test_plan_counts_the_training_of_a_model_a_record_measures(toy_step):
    """A record measuring a fine-tuned model costs its own time plus the run that made the model (the audit's
    machine may train it first): the plan's budget sees both."""
    store.measure("toy", "m", {"x": 1}, lambda: 1.0, produces="m-tuned-abc")
    store.measure("toy", "m", {"model": "m-tuned-abc", "x": 2}, lambda: 2.0)
    store.measure("toy", "m", {"model": "m-tuned-abc-halfway", "x": 3}, lambda: 3.0)
    store.measure("toy", "m", {"model": "m", "x": 4}, lambda: 4.0)
    for p in store.folder("m").glob("toy/*.json"):  # give every record a known wall time
        doc = json.loads(p.read_text())
        doc["provenance"]["wall_s"] = 100.0 if doc["provenance"].get("produces") else 1.0
        p.write_text(json.dumps(doc))
    rows = store.inventory(["m"])
    cost = store._costs(rows)
    by_x = {json.loads((store.root() / r["record"]).read_text())["params"]["x"]: cost[r["record"]] for r in rows}
    assert by_x == {1: 100.0, 2: 101.0, 3: 101.0, 4: 1.0}
