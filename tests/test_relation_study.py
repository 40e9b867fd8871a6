"""Paper C's protocol pipeline: MLP sites, one-pass answering, facts files and setup,
on tiny random models."""
import json

import numpy as np
import pytest
import torch

from lib import hooks, metrics, models
from lib.infra import cache
from lib.papers import relations
from lib.papers.relations import study as relation_study


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    from lib.infra import paths

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "CACHE", tmp_path_factory.mktemp("study-cache"))
        yield


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_units_index_round_trips_and_names_sites(family):
    lm = models.tiny_random(family)
    sites = ("up", "down") if family == "gpt2" else ("up", "gate", "down")
    u = relations.Units.of(lm, sites)
    info = lm.info
    assert u.size == info.n_layers * (info.d_mlp * (len(sites) - 1) + info.d_model)
    flat = np.arange(u.size)
    s, L, i = u.split(flat)
    assert (np.bincount(s) == [info.n_layers * w for w in u.widths]).all()
    assert L.max() == info.n_layers - 1 and (i < np.asarray(u.widths)[s]).all()
    assert u.labels([0])[0] == "up:L0N0" and u.labels([u.size - 1])[0] == f"down:L{info.n_layers - 1}N{info.d_model - 1}"
    assert len(np.unique(u.stratum(flat))) == len(sites) * info.n_layers
    with pytest.raises(ValueError, match="out of range"):
        u.split([u.size])
    with pytest.raises(ValueError, match="unknown MLP site"):
        relations.Units.of(lm, ("mlp",))
    if family == "gpt2":
        with pytest.raises(ValueError, match="no 'gate'"):
            relations.Units.of(lm, ("gate",))


def test_recorder_act_site_equals_mlp_recorder_and_zeroing_up_equals_zeroing_act():
    lm = models.tiny_random("llama")
    texts = ["the cat sat on the mat", "a dog", "hello there world"]
    ref = hooks.mlp_activation_stats(lm, texts, pooled=True, progress=False).pooled  # [n, L, d_mlp]
    u = relations.Units.of(lm, ("act",))
    got = relations.answer(lm, texts, ["x"] * 3, n_tokens=1, units=u, record=True).pooled
    torch.testing.assert_close(got.float(), ref.reshape(3, -1), atol=2e-3, rtol=1e-2)  # fp16 storage
    enc = hooks.encode(lm, texts[:1])
    up = relations.Units.of(lm, ("up", "gate", "down"))
    with torch.no_grad():
        base = lm.model(**enc).logits
        with relations.zero_units(lm, up, []):
            same = lm.model(**enc).logits
        with relations.zero_units(lm, up, [1 * lm.info.d_mlp + 5]):  # up:L1N5
            a = lm.model(**enc).logits
        with hooks.intervene(lm, [(1, 5, "zero", 0.0)]):  # act:L1N5
            b = lm.model(**enc).logits
    torch.testing.assert_close(base, same)  # nothing off: identical output
    assert not torch.allclose(base, a)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # act = act(gate) * up: 0 either way


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_answer_matches_generate(family):
    lm = models.tiny_random(family)
    prompts = ["the cat sat", "a dog", "hello there my good friend"]
    gen = metrics.generate(lm, prompts, max_new_tokens=3, progress=False, score_tokens=[5, 6, 7])
    golds = [gen.continuations[0], "zzzz", gen.continuations[2][:2] or "q"]
    a = relations.answer(lm, prompts, golds, n_tokens=3, rule="starts")
    assert a.continuation == gen.continuations
    assert a.correct.tolist() == [relations.matches(c, g, "starts") for c, g in zip(gen.continuations, golds)]
    t = [relations.gold_first_token(lm, g) for g in golds]
    g2 = metrics.generate(lm, prompts, max_new_tokens=1, progress=False, score_tokens=t)
    np.testing.assert_allclose(a.logprob, g2.first_token_logprob, atol=1e-4)
    assert a.rank.tolist() == g2.first_token_rank
    u = relations.Units.of(lm, ("up", "down"))
    off = relations.answer(lm, prompts, golds, n_tokens=3, units=u, off=np.arange(u.size))
    assert len(off.continuation) == 3
    with pytest.raises(ValueError, match="units"):
        relations.answer(lm, prompts, golds, off=[1])


@pytest.mark.parametrize("cont,gold,rule,ok", [
    (" Tok", "Tokyo", "prefix", True), (" Paris,", "Paris", "prefix", True), (" Pa", "Paris", "starts", False),
    (" Paris is", "Paris", "starts", True), (" Lyon", "Paris", "prefix", False), ("  ", "Paris", "prefix", False),
    (" The city", "Paris", "prefix", False)])
def test_matches(cont, gold, rule, ok):
    assert relations.matches(cont, gold, rule) is ok


def test_matches_rejects_unknown_rule():
    with pytest.raises(ValueError, match="rule"):
        relations.matches("a", "a", "exact")


def write_facts(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_read_facts_format_and_errors(tmp_path):
    rows = [{"subject": f"s{i}", "relation": "r1", "object": "o", "templates": ["{} is", "about {}:"], "language": "en"}
            for i in range(3)] + [{"subject": "t", "relation": "r2", "object": "p", "template": "{} ->"}]
    f = relations.read_facts(write_facts(tmp_path / "f.jsonl", rows))
    assert sorted(f) == ["r1", "r2"] and f["r1"]["templates"] == ["{} is", "about {}:"] and len(f["r1"]["samples"]) == 3
    assert f["r2"]["language"] == "en" and f["r2"]["samples"] == [{"subject": "t", "object": "p"}]
    bad = {"missing field": [{"subject": "s", "relation": "r"}],
           "one '{}'": [{"subject": "s", "relation": "r", "object": "o", "template": "no slot"}],
           "mixes languages": [{**rows[0]}, {**rows[1], "language": "de"}],
           "not JSON": None}
    for what, content in bad.items():
        p = tmp_path / "bad.jsonl"
        if content is None:
            p.write_text("{not json\n")
        else:
            write_facts(p, content)
        with pytest.raises(ValueError, match="needs|one|mixes|not JSON"):
            relations.read_facts(p)
    with pytest.raises(FileNotFoundError, match="data/README.md"):
        relations.read_facts(tmp_path / "nope.jsonl")


def test_facts_file_errors_name_the_file_and_line(tmp_path):
    """A template without '{}' names the line that holds it (not only the relation, whose lines may be many);
    a byte that is not UTF-8 names its line too."""
    rows = [{"subject": "s0", "relation": "r1", "object": "o", "templates": ["{} is"]},
            {"subject": "s1", "relation": "r1", "object": "o", "templates": ["{} is", "no slot"]}]
    with pytest.raises(ValueError) as e:
        relations.read_facts(write_facts(tmp_path / "facts.jsonl", rows))
    assert str(e.value) == "facts.jsonl line 2: every template needs exactly one '{}' for the subject, got 'no slot'"
    with pytest.raises(ValueError, match=r"^facts.jsonl line 1: .*got '\{\} and \{\}'"):
        relations.read_facts(write_facts(tmp_path / "facts.jsonl", [{"subject": "s", "relation": "r", "object": "o",
                                                                     "template": "{} and {}"}]))
    (tmp_path / "facts.jsonl").write_bytes(b'{"subject": "M\xfcnchen", "relation": "r", "object": "o", "template": "{} is"}\n')
    with pytest.raises(ValueError, match=r"^facts.jsonl line 1: not UTF-8 text \(byte 0xfc at byte 15 of the line\)"):
        relations.read_facts(tmp_path / "facts.jsonl")


def test_a_misspelled_setting_names_the_closest_field(tmp_path):
    f = write_facts(tmp_path / "mine.jsonl", [{"subject": f"w{i}", "relation": rel, "object": "the", "template": "{} is"}
                                              for rel in ("ra", "rb") for i in range(3)])
    with pytest.raises(ValueError) as e:  # before any model loads
        relations.setup("tiny", facts=str(f), n_tset=4, max_idnet=8, zzz=1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("unknown setting(s) 'max_idnet' (did you mean 'max_ident'?), 'n_tset' "
                                             "(did you mean 'n_test'?), 'zzz': use fields of relations.Sizes (n_test, ")


def test_split_by_id_is_aligned_and_disjoint():
    en = [{"subject": f"q{i} en", "object": "a", "id": i} for i in range(40)]
    fr = [{"subject": f"q{i} fr", "object": "a", "id": i} for i in reversed(range(40))]
    a, b = relations.split_by_id(en, 10, 0, 20, seed=3), relations.split_by_id(fr, 10, 0, 20, seed=3)
    assert [f["id"] for f in a[1]] == [f["id"] for f in b[1]]  # the same test facts in both languages
    assert not {f["id"] for f in a[1]} & {f["id"] for f in a[2]} and len(a[2]) == 20
    assert relations.split_by_id(en, 10, 0, 5, seed=3)[1] == a[1]  # the test split does not depend on max_ident


def test_random_units_match_site_and_layer_blocks():
    lm = models.tiny_random("llama")
    u = relations.Units.of(lm, ("up", "gate", "down"))
    like = np.array([0, 1, 2, u.size - 1, u.size - 2, lm.info.d_mlp * lm.info.n_layers + 7])
    r = relations.random_units(u, like, seed=1)
    assert sorted(u.stratum(r).tolist()) == sorted(u.stratum(like).tolist())
    assert not set(r.tolist()) & set(like.tolist())
    assert np.array_equal(r, relations.random_units(u, like, seed=1))
    assert not np.array_equal(r, relations.random_units(u, like, seed=2))


def test_setup_runs_on_a_user_facts_file_and_refuses_bad_settings(tmp_path):
    lm = models.tiny_random("llama")
    rows = [{"subject": f"w{i}", "relation": rel, "object": "the", "templates": ["{} is", "of {} we say"]}
            for rel in ("ra", "rb") for i in range(12)]
    f = write_facts(tmp_path / "mine.jsonl", rows)
    study = relations.setup("tiny", lm=lm, facts=str(f), n_test=4, min_correct=1, max_ident=8, progress=False)
    assert set(study.screen.index) == {"ra", "rb"}
    assert (study.screen["test facts"] == 4).all() and (study.screen["identification facts screened"] == 8).all()
    for name in study.names:  # whatever the random model answers, the pieces fit together
        pos, neg = study.ident_rows[name]
        assert len(pos) >= 1 and 0 < len(neg) <= 4 * len(pos)
        assert (study.row_relation[pos] == name).all() and (study.row_relation[neg] != name).all()
        assert study.row_correct[pos].all()
        top = study.top(name)
        assert len(top) == study.k and len(set(top.tolist())) == study.k
    assert study.k == round(relations.PROTOCOLS["paper"].k_fraction * study.units.size) or study.k == 1
    df = study.run()
    assert len(df) == len(study.tests.prompts) and df["logprob"].le(0).all()
    again = relations.setup("tiny", lm=lm, facts=str(f), n_test=4, min_correct=1, max_ident=8, progress=False)
    assert again.fingerprint == study.fingerprint and torch.equal(again.ap, study.ap)  # from the cache
    with pytest.raises(ValueError, match="unknown setting"):
        relations.setup("tiny", lm=lm, facts=str(f), n_tset=4)
    with pytest.raises(ValueError, match="protocol"):
        relations.setup("tiny", lm=lm, facts=str(f), protocol="mine")
    with pytest.raises(ValueError, match="n_test must be a positive integer"):
        relations.setup("tiny", lm=lm, facts=str(f), n_test=0)
    with pytest.raises(ValueError, match="unknown relations"):
        relations.setup("tiny", lm=lm, facts=str(f), relations="ra,zz")


@pytest.mark.parametrize("stem", ["11_relation_specific_neurons"])
def test_notebook_runs_on_a_user_facts_file(tmp_path, stem):
    """`facts=` replaces LRE in a notebook. A tiny random model knows none of the facts,
    so nothing is selected: the notebook must still run to its verdict ("inconclusive")."""
    import papermill

    from lib.infra import paths

    folder = tmp_path / "tiny-llama"
    models.tiny_random("llama", folder=folder)
    rows = [{"subject": f"w{i}", "relation": rel, "object": "zebra", "templates": ["{} is", "of {} we say"]}
            for rel in ("ra", "rb") for i in range(20)]
    f = write_facts(tmp_path / "mine.jsonl", rows)
    out = tmp_path / "out.ipynb"
    env_cache = tmp_path / "cache"
    import os
    old = {k: os.environ.get(k) for k in ("COMPENDIUM_CACHE", "COMPENDIUM_PROGRESS")}
    os.environ.update({"COMPENDIUM_CACHE": str(env_cache), "COMPENDIUM_PROGRESS": "0"})
    try:
        papermill.execute_notebook(str(paths.NOTEBOOKS / f"{stem}.ipynb"), str(out), cwd=str(paths.NOTEBOOKS),
                                   parameters={"model_name": str(folder), "device": "cpu", "facts": str(f),
                                               "overrides": {"n_test": 5, "min_correct": 1, "max_ident": 10}},
                                   progress_bar=False, kernel_name="python3")
    finally:
        import shutil

        for d in (paths.RESULTS / paths.slug(str(folder)), paths.FIGURES / paths.slug(str(folder))):
            shutil.rmtree(d, ignore_errors=True)  # the run's records and figures: not the repository's
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = out.read_text(encoding="utf-8")
    assert "ra" in text and "rb" in text  # the screen table names the user's relations
    assert "inconclusive" in text or "holds" in text


def test_score_many_equals_one_task_at_a_time_and_sklearn():
    from sklearn.metrics import average_precision_score

    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(30, 50, generator=g).half()
    pooled[:, :5] = pooled[:, :5].round()  # ties
    tasks = [(np.arange(0, 6), np.arange(10, 30)), (np.arange(6, 10), np.r_[0:3, 20:30]), (np.r_[25:30], np.arange(0, 8))]
    ap, tie = relations.score_many(pooled, tasks)
    assert ap.shape == tie.shape == (3, 50)
    for t, (p, q) in enumerate(tasks):
        a1, t1 = relation_study._score(pooled, p, q)
        torch.testing.assert_close(ap[t], a1)
        x = pooled[np.r_[p, q]].float().numpy()
        y = np.r_[np.ones(len(p)), np.zeros(len(q))]
        ref = [average_precision_score(y, x[:, u]) for u in range(50)]
        np.testing.assert_allclose(ap[t].numpy(), ref, atol=1e-5)
        d = (x[:len(p)].mean(0) - x[len(p):].mean(0)) / x.std(0, ddof=1)
        np.testing.assert_allclose(tie[t].numpy(), d, rtol=1e-4, atol=1e-5)
    top = relations.top_of(ap[0], tie[0], 7)
    assert len(set(top.tolist())) == 7 and ap[0][top].min() >= ap[0].sort(descending=True).values[6] - 1e-9
    with pytest.raises(ValueError, match="both positive and negative"):
        relations.score_many(pooled, [(np.arange(3), np.arange(2, 6))])


def test_study_and_its_runs_are_records_read_back_without_a_forward_pass(tmp_path, monkeypatch):
    """Paper C's measurements are records: a second setup and the same runs read them (no answering at all),
    a changed fact is a new record, strict mode computes nothing, and the identification responses a new
    scoring needs are measured again on the study's own rows (close to those the study was scored on)."""
    from lib.infra import store

    lm = models.tiny_random("llama")
    subjects = [f"w{i}" for i in range(24)]
    said = relations.answer(lm, [f"{s} is" for s in subjects], ["x"] * len(subjects)).continuation
    rows = [{"subject": s, "relation": "ra" if i < 12 else "rb", "object": said[i], "templates": ["{} is"]}
            for i, s in enumerate(subjects) if said[i].strip()]  # the objects are what the model answers
    f = write_facts(tmp_path / "mine.jsonl", rows)
    kw = dict(lm=lm, facts=str(f), n_test=3, min_correct=1, max_ident=8, progress=False)
    study = relations.setup("tiny", **kw)
    assert len(study.names) == 2
    first = study.pooled.clone()  # kept from the identification pass
    base = study.run()
    name = study.names[0]
    tasks = [study.ident_rows[name]]
    ranked = study.rank_many(tasks, 5)
    ap, tie = study.ap_many(tasks)
    assert np.array_equal(ranked[0], relations.top_of(ap[0], tie[0], 5))
    n_records = len(list(store.root().rglob("*.json*")))
    with monkeypatch.context() as m:
        m.setattr(relations, "answer", lambda *a, **k: pytest.fail("answered again instead of reading a record"))
        m.setenv(store.RECORDS_ENV, "strict")
        again = relations.setup("tiny", **kw)
        assert again.pooled_rows is None and torch.equal(again.ap, study.ap) and again.names == study.names
        assert again.run().equals(base) and np.array_equal(again.rank_many(tasks, 5), ranked)
        with pytest.raises(store.MissingRecord, match="relation-answers"):
            again.run(off=study.top(name))  # never measured: strict mode names the record instead of computing it
    changed = [dict(r, object=r["object"] + "z") if i == 0 else r for i, r in enumerate(rows)]  # one changed fact
    other = relations.setup("tiny", **{**kw, "facts": str(write_facts(tmp_path / "changed.jsonl", changed))})
    assert other.fingerprint != study.fingerprint
    assert len(list(store.root().rglob("*.json*"))) > n_records  # a new study record, not the old one
    fresh = relations.setup("tiny", **kw)
    monkeypatch.setattr(cache, "get_or_build", lambda kind, m, p, build, **k: build())  # no cached responses
    fresh.pooled_rows = None
    torch.testing.assert_close(fresh.pooled.float(), first.float(), atol=2e-2, rtol=2e-2)


def test_audit_tolerances_of_paper_c_pass_agreement_and_fail_beyond_it():
    """Each paper C step's comparison passes a record against itself and fails a planted disagreement."""
    from lib.infra import store

    rng = np.random.default_rng(0)
    ans = {"continuation": ["a"] * 40, "correct": rng.random(40) < 0.5, "rank": np.zeros(40, int), "logprob": -rng.random(40)}
    ok = store.STEPS["relation-answers"].compare(ans, ans)
    assert all(c.ok for c in ok)
    worse = dict(ans, correct=np.zeros(40, bool), logprob=ans["logprob"] - 5)
    assert not all(c.ok or c.info for c in store.STEPS["relation-answers"].compare(ans, worse))
    ap = torch.rand(2, 500)
    study = {"chosen": ["ra", "rb"], "correct": ans["correct"], "ap": ap, "tiebreak": torch.zeros(2, 500), "k": 20}
    assert all(c.ok for c in store.STEPS["relation-study"].compare(study, study))
    shuffled = dict(study, ap=ap[:, torch.randperm(500)])  # other units on top
    assert not all(c.ok or c.info for c in store.STEPS["relation-study"].compare(study, shuffled))
    assert not store.STEPS["relation-study"].compare(study, dict(study, chosen=["ra"]))[0].ok
    ranks = np.stack([rng.permutation(500)[:20] for _ in range(3)])
    assert store.STEPS["relation-ranking"].compare(ranks, ranks)[0].ok
    others = np.stack([np.setdiff1d(np.arange(500), r)[:20] for r in ranks])  # disjoint top sets
    assert not store.STEPS["relation-ranking"].compare(ranks, others)[0].ok
    attr = torch.randn(300)
    assert store.STEPS["relation-attribution"].compare(attr, attr + 1e-4 * torch.randn(300))[0].ok
    assert not store.STEPS["relation-attribution"].compare(attr, torch.randn(300))[0].ok
