"""lib.infra.cache: content hashes, and artifacts derived from data keyed by that data.

A cached artifact made from prompt texts, facts, pairs or labelled rows must be rebuilt when one of
them changes; here the data files are copies in a scratch folder, edited one line at a time."""
from __future__ import annotations

import hashlib
import json
import shutil
import types

import numpy as np
import pandas as pd
import pytest
import torch

from lib import data, models
from lib.infra import cache, paths, store
from lib.papers import dpo
from lib.papers.dpo import neurons as dpo_neurons
from lib.papers.saobp import scratch as lib_scratch

ROOT_DATA = paths.DATA


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """An empty cache and a private copy of the data files the cached artifacts read."""
    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    for part in ("lee2024", "davidson", "jigsaw", "glue/SST-2"):
        shutil.copytree(ROOT_DATA / part, tmp_path / "data" / part)
    monkeypatch.setattr(data, "DATA", tmp_path / "data")
    yield tmp_path
    torch.set_grad_enabled(True)


def edit_jsonl(path, row: int, field: str, text: str) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows[row][field] = text
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ----------------------------------------------------------------------------- content_hash


def test_content_hash_is_sha256_of_canonical_json():
    # plain texts and numbers: the canonical JSON is the JSON itself
    assert cache.content_hash(["a prompt", 1, 2.5, None]) == hashlib.sha256(
        json.dumps(["a prompt", 1, 2.5, None]).encode()).hexdigest()
    assert cache.content_hash({"b": 1, "a": [1, 2]}) == cache.content_hash({"a": [1, 2], "b": 1})  # key order
    assert cache.content_hash(("x", "y")) == cache.content_hash(["x", "y"])


def test_content_hash_sees_one_changed_character_label_or_value():
    prompts = ["The capital of France is", "Water boils at"]
    h = cache.content_hash(prompts)
    assert cache.content_hash(list(prompts)) == h
    assert cache.content_hash(["The capital of France is ", "Water boils at"]) != h
    assert cache.content_hash([prompts, [0, 1]]) != cache.content_hash([prompts, [1, 0]])  # labels
    assert cache.content_hash([1]) != cache.content_hash(["1"]) != cache.content_hash([True])
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert cache.content_hash(t) == cache.content_hash(t.clone()) == cache.content_hash(t.numpy())
    assert cache.content_hash(t) != cache.content_hash(t.reshape(3, 2))  # shape
    assert cache.content_hash(t) != cache.content_hash(t.double())  # dtype
    u = t.clone()
    u[1, 2] = float(np.nextafter(np.float32(5.0), np.float32(6.0)))  # one float, one ulp
    assert cache.content_hash(u) != cache.content_hash(t)
    assert cache.content_hash(t.bfloat16()) == cache.content_hash(t.clone().bfloat16())
    df = pd.DataFrame({"text_a": ["good", "bad"], "text_b": [None, None], "label": [1, 0]})
    assert cache.content_hash(df) == cache.content_hash(df.copy())
    df2 = df.copy()
    df2.loc[1, "text_a"] = "bad!"
    assert cache.content_hash(df2) != cache.content_hash(df)
    assert cache.content_hash({"s": {"b", "a"}}) == cache.content_hash({"s": {"a", "b"}})
    with pytest.raises(TypeError, match="cannot hash"):
        cache.content_hash(object())


def test_get_or_build_with_a_content_key_rebuilds_for_new_texts(scratch):
    builds = []

    def artifact(texts):
        params = {"n": len(texts), "texts": cache.content_hash(texts)}
        return cache.get_or_build("lengths", "m", params, lambda: builds.append(1) or [len(t) for t in texts])

    assert artifact(["ab", "c"]) == [2, 1] and len(builds) == 1
    assert artifact(["ab", "c"]) == [2, 1] and len(builds) == 1  # same texts: from the cache
    assert artifact(["ab", "cd"]) == [2, 2] and len(builds) == 2  # same sizes, one text changed


# ----------------------------------------------------------------------------- the evaluation cache of 03, 05, 06


@pytest.fixture(scope="module")
def pair():
    """A tiny random 'base' decoder and a differently initialised 'tuned' one."""
    return models.tiny_random("llama", seed=0), models.tiny_random("llama", seed=1)


def test_reference_evaluations_are_rebuilt_when_a_prompt_changes(pair, scratch):
    """dpo_neurons.reference_evaluations with dpo.toxicity_perplexity_f1, as notebooks 03, 05 and 06
    call it: the cache key held only the sizes and the scorer, so an edited challenge prompt gave the
    old prompts' base and DPO numbers. Now the prompts' content hash is in the key."""
    base, tuned = pair
    kw = dict(n_prompts=2, n_wiki=2, max_new_tokens=3, scorer="profanity-check", progress=False)

    def ref():
        return dpo_neurons.reference_evaluations("tiny", base, tuned, {"steps": 1}, dpo.toxicity_perplexity_f1,
                                                 **kw)

    def files():  # the evaluations' records in the test's measurement store
        return sorted((scratch / "store").rglob("toxicity-perplexity-f1/*.json*"))

    first = ref()
    assert len(files()) == 2  # base and tuned
    stamps = [p.stat().st_mtime_ns for p in files()]
    assert ref() == first and [p.stat().st_mtime_ns for p in files()] == stamps  # read from the records
    # a prompt the evaluation does not read (row 10 > n_prompts): still the cache
    edit_jsonl(scratch / "data" / "lee2024" / "challenge_prompts.jsonl", 10, "prompt", "never read")
    assert ref() == first and len(files()) == 2
    # one of the two prompts it reads: both models are evaluated again, on the new prompt
    edit_jsonl(scratch / "data" / "lee2024" / "challenge_prompts.jsonl", 0, "prompt",
               "You are a complete and utter idiot, and")
    again = ref()
    assert len(files()) == 4
    direct = dpo.toxicity_perplexity_f1(base, **kw)
    assert again["base"] == direct  # the new result is the new prompt's, not the old one's
    assert data.challenge_prompts(2)[0] == "You are a complete and utter idiot, and"
    # a wiki text (perplexity and F1) counts as well
    edit_jsonl(scratch / "data" / "lee2024" / "wiki_samples.jsonl", 1, "gold", "An entirely different gold text.")
    ref()
    assert len(files()) == 6


# ----------------------------------------------------------------------------- the other data-derived artifacts


@pytest.fixture
def keys(monkeypatch):
    """The params each get_or_build call receives (nothing is built)."""
    seen = []
    def record(kind, model, params, build, **kw):
        kind = {"preference-pairs": "pairs"}.get(kind, kind)
        seen.append((kind, params))
        if kind == "probe":
            return types.SimpleNamespace()
        return {"pairs": pd.DataFrame(), "n_tried": 0, "n_looping": 0, "scorer": "none"} if kind == "pairs" else None

    monkeypatch.setattr(cache, "get_or_build", record)  # artifacts (lib.infra.cache)
    monkeypatch.setattr(store, "measure", record)  # records (lib.infra.store)
    return seen


def test_probe_key_holds_the_tweets(pair, scratch, keys):
    lm = pair[0]
    dpo.train_probe(lm, n_per_class=10, progress=False)
    texts, _ = dpo.probe_data(10, 0)
    csv = scratch / "data" / "davidson" / "tweets_balanced.csv"
    df = pd.read_csv(csv)
    df.loc[df.tweet == texts[0], "tweet"] = texts[0] + " (edited)"
    df.to_csv(csv, index=False)
    dpo.train_probe(lm, n_per_class=10, progress=False)
    (k1, p1), (k2, p2) = keys
    assert k1 == k2 == "probe" and p1["data"] != p2["data"]
    assert {k: v for k, v in p1.items() if k != "data"} == {k: v for k, v in p2.items() if k != "data"}


def test_preference_pairs_key_holds_the_prompts(pair, scratch, keys):
    lm = pair[0]
    d = lm.info.d_model
    probe = dpo.Probe(torch.zeros(d), 0.0, 1.0, 1.0, 1, steer_layer=0, steer_direction=torch.ones(d))
    dpo.preference_pairs(lm, probe, n_pairs=2, scorer="profanity-check", progress=False)
    edit_jsonl(scratch / "data" / "lee2024" / "wiki_samples.jsonl", dpo.Sizes.pair_offset, "prompt",
               "An edited pair prompt")
    dpo.preference_pairs(lm, probe, n_pairs=2, scorer="profanity-check", progress=False)
    (_, p1), (_, p2) = keys
    assert p1["prompts"] != p2["prompts"]


def test_saobp_scratch_run_key_holds_the_task_rows(scratch, keys):
    lib_scratch.scratch_run("SST-2", "mini", 0, "baseline", steps=1)
    tsv = scratch / "data" / "glue" / "SST-2" / "train_sample.tsv"
    lines = tsv.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[1] = "an edited training sentence \t1\n"
    tsv.write_text("".join(lines), encoding="utf-8")
    lib_scratch.scratch_run("SST-2", "mini", 0, "baseline", steps=1)
    (k1, p1), (k2, p2) = keys
    assert k1 == k2 == "scratch-run" and p1["data"] != p2["data"]


def test_finetune_key_holds_the_encodings(scratch, monkeypatch):
    """scratch.finetune's artifact is keyed by the encodings' content: one changed token id, a new key."""
    import torch
    from lib.papers.saobp import scratch as sc
    from lib.infra import cache

    seen = []
    monkeypatch.setattr(store, "measure", lambda kind, model, params, build, **kw: seen.append(params))
    enc = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
           "labels": torch.tensor([0])}
    kw = dict(n_labels=2, steps=1, batch_size=1, lr=1e-3, j_lr=1e-2, key={"task": "t"})
    sc.finetune("minilm-l6", "baseline", 0, enc, enc, enc, **kw)
    edited = {**enc, "input_ids": torch.tensor([[1, 2, 4]])}
    sc.finetune("minilm-l6", "baseline", 0, edited, enc, enc, **kw)
    assert seen[0]["data"] != seen[1]["data"] and {k: v for k, v in seen[0].items() if k != "data"} == \
        {k: v for k, v in seen[1].items() if k != "data"}


def test_atomic_save_of_a_folder_keeps_one_written_meanwhile(tmp_path):
    # two processes building the same folder side by side (02 and 03 training one DPO run): with
    # keep_existing the second leaves the first's folder in place; without it, the folder is replaced
    def folder_with(text):
        def save(_, p):
            p.mkdir()
            (p / "weights.txt").write_text(text)
        return save

    target = tmp_path / "run"
    cache.atomic_save(None, target, folder_with("first"))
    cache.atomic_save(None, target, folder_with("second"), keep_existing=True)
    assert (target / "weights.txt").read_text() == "first"
    cache.atomic_save(None, target, folder_with("third"))
    assert (target / "weights.txt").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary folder left behind
