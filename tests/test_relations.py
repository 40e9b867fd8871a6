"""Relation-neuron method (lib.relations) on tiny random models and hand-made cases."""
import numpy as np
import pytest
import torch

from lib import hooks, metrics, models, relations


# ----------------------------------------------------------------------------- AP (shared metric)


def test_torch_average_precision_equals_sklearn_with_ties():
    rng = np.random.default_rng(0)
    for trial in range(12):
        n = int(rng.integers(4, 40))
        s = rng.integers(0, 3, (n, 30)).astype(float) if trial % 2 else rng.normal(size=(n, 30))
        y = rng.integers(0, 2, n)
        y[:2] = [1, 0]
        ref = metrics.average_precision(s, y)
        np.testing.assert_allclose(metrics.average_precision(s, y, backend="torch"), ref, atol=1e-6)
        both = metrics.average_precision(s, np.stack([y, 1 - y], 1), backend="torch")  # [2, units]
        np.testing.assert_allclose(both[0], ref, atol=1e-6)
        np.testing.assert_allclose(both[1], metrics.average_precision(s, 1 - y), atol=1e-6)
    with pytest.raises(ValueError, match="backend"):
        metrics.average_precision(s, y, backend="numpy")


def test_planted_neuron_has_ap_one_and_the_rest_do_not():
    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(40, 3, 16, generator=g)  # [n_prompts, n_layers, d_mlp]
    labels = np.array(["a"] * 10 + ["b"] * 15 + ["c"] * 15)
    pooled[:10, 1, 7] += 10.0  # layer 1, neuron 7 fires on relation a's prompts only
    ap = relations.ap_scores(pooled, labels, ["a", "b", "c"])
    assert ap.shape == (3, 3, 16)
    assert ap[0, 1, 7] == pytest.approx(1.0)
    assert (ap[0].flatten().topk(2).values[1] < 1.0)
    assert relations.top_neurons(ap[0], 1).tolist() == [[1, 7]]
    # the slow obvious way, one neuron with sklearn
    ref = metrics.average_precision(pooled[:, 2, 3].numpy(), (labels == "b").astype(int))
    assert ap[1, 2, 3].item() == pytest.approx(float(np.ravel(ref)[0]), abs=1e-6)


def test_top_neurons_order_and_random_controls():
    ap = torch.zeros(4, 10)
    ap[2, 3], ap[0, 1], ap[3, 9] = 0.9, 0.8, 0.8
    top = relations.top_neurons(ap, 3)
    assert top.tolist() == [[2, 3], [0, 1], [3, 9]]  # ties broken by position
    like = np.array([[1, 0], [1, 1], [1, 2], [3, 5]])
    r = relations.random_neurons(like, 4, 10, seed=1)
    assert relations.layer_counts(r, 4).tolist() == relations.layer_counts(like, 4).tolist()
    assert not set(map(tuple, r.tolist())) & set(map(tuple, like.tolist()))
    assert np.array_equal(r, relations.random_neurons(like, 4, 10, seed=1))
    u = relations.random_neurons(like, 4, 10, seed=2, match_layers=False)
    assert len(u) == 4 and len(set(map(tuple, u.tolist()))) == 4


# ----------------------------------------------------------------------------- splits and accuracy


def test_split_is_deterministic_and_disjoint():
    facts = [{"subject": f"s{i}", "object": f"o{i}"} for i in range(30)] + [{"subject": "s3", "object": "dup"}]
    a = relations.split_facts(facts, 10, 12, n_demos=3, seed=5)
    b = relations.split_facts(list(reversed(facts)), 10, 12, n_demos=3, seed=5)
    assert a == b  # independent of input order
    demos, ident, test = a
    assert (len(demos), len(ident), len(test)) == (3, 10, 12)
    subj = [f["subject"] for part in a for f in part]
    assert len(subj) == len(set(subj))
    assert relations.split_facts(facts, 10, 12, 3, seed=6) != a
    d, i, t = relations.split_facts(facts[:10], 20, 20, n_demos=2)  # too few facts: shared fairly
    assert (len(d), len(i), len(t)) == (2, 4, 4)


def test_lre_and_klar_relations_prompts():
    rels = relations.lre_relations(["country_capital_city", "country_language"], n_ident=5, n_test=5, shots=2)
    r = rels["country_capital_city"]
    p = r.test_prompts()[0]
    assert p.count("\n") == 2 and p.endswith(r.templates[0].format(r.test[0]["subject"]))
    assert not {f["subject"] for f in r.demos} & {f["subject"] for f in r.test}
    en = relations.klar_relations("eng_Latn", ["capital_of"], n_ident=4, n_test=4)
    fr = relations.klar_relations("fra_Latn", ["capital_of"], n_ident=4, n_test=4)
    assert [f["index"] for f in en["capital_of"].test] == [f["index"] for f in fr["capital_of"].test]  # same facts
    assert len(fr["capital_of"].test) == 4 and fr["capital_of"].test[0]["subject"] != en["capital_of"].test[0]["subject"]
    two = relations.klar_relations("fra_Latn", ["capital_of"], n_ident=4, n_test=4, shots=2)["capital_of"]
    assert two.test_prompts()[0].count("\n") == 2 and two.test_prompts()[0].endswith(two.test[0]["subject"])


@pytest.mark.parametrize("cont,gold,ok", [
    (" Paris is", "Paris", True), ("paris.", "Paris", True), ("\n  PARIS", " paris ", True),
    (" Pa", "Paris", False), (" The city of Paris", "Paris", False), ("Washington D.C. is", "Washington D.C.", True),
    (" anything", "", False)])
def test_is_correct(cont, gold, ok):
    assert relations.is_correct(cont, gold) is ok


def test_specific_needs_to_beat_the_largest_control_drop():
    # issue 14 point 8: a drop of 0.00 beat the *smallest* random drop (-0.10) and counted as specific
    assert not relations.is_specific(0.0, -0.05, [-0.10, 0.05])
    assert not relations.is_specific(0.05, -0.05, [-0.10, 0.05])  # equal to the largest: not beyond it
    assert relations.is_specific(0.10, -0.05, [-0.10, 0.05])
    assert not relations.is_specific(0.10, 0.20, [-0.10, 0.05])  # the other relations drop more
    with pytest.raises(ValueError, match="control"):
        relations.is_specific(0.1, 0.0, [])


def test_max_pair_ap_sum_matches_every_interleaving():
    from itertools import combinations

    for n_a, n_b in [(1, 1), (2, 3), (4, 4), (3, 5)]:
        n, best = n_a + n_b, 0.0
        for pos_a in combinations(range(n), n_a):  # ranks of a's prompts; b's fill the rest, negatives below
            y_a = np.isin(np.arange(n), pos_a).astype(int)
            score = np.concatenate([np.arange(n, 0, -1.0), -np.ones(5)])  # rank order, then 5 other prompts
            y = np.concatenate([y_a, np.zeros(5, int)]), np.concatenate([1 - y_a, np.zeros(5, int)])
            best = max(best, sum(float(np.ravel(metrics.average_precision(score, t))[0]) for t in y))
        assert relations.max_pair_ap_sum(n_a, n_b) == pytest.approx(best)
    assert relations.max_pair_ap_sum(1, 1) == pytest.approx(1.5)
    # with 12 positives each, no neuron reaches AP 0.75 for two relations at once (13's top-200 sets)
    assert relations.max_pair_ap_sum(12, 12) < 2 * 0.75


def test_overlaps():
    inter, jac = relations.overlap_matrix({"a": np.array([[0, 1], [0, 2]]), "b": np.array([[0, 2], [1, 1]])})
    assert inter.loc["a", "b"] == 1 and jac.loc["a", "b"] == pytest.approx(1 / 3) and jac.loc["a", "a"] == 1
    e, j = relations.chance_overlap(10, 1000)
    assert e == pytest.approx(0.1) and 0 < j < 0.01


# ----------------------------------------------------------------------------- end to end on tiny models


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "mistral"])
def test_planted_marker_neuron_is_found_and_zeroing_it_changes_the_output(family):
    lm = models.tiny_random(family)
    marker = lm.tokenizer("zebra", add_special_tokens=False)["input_ids"][0]
    L, i = 1, 3
    # plant: neuron (L, i) reads a direction only the marker token's embedding has
    emb = lm.model.get_input_embeddings().weight
    direction = torch.zeros(lm.info.d_model)
    direction[0] = 1.0
    with torch.no_grad():
        emb[:, 0] = 0.0
        emb[marker, 0] = 50.0
    mlp = lm.model.base_model.get_submodule(lm.info.mlp_out.format(L=L).rsplit(".", 1)[0])
    out_name = lm.info.mlp_out.rsplit(".", 1)[1]
    with torch.no_grad():  # every input projection of layer L's MLP: neuron i reads only that direction
        for n, p in mlp.named_parameters():
            if n.startswith(out_name + "."):
                continue
            if p.dim() == 2:
                rows = p if p.shape[0] == lm.info.d_mlp else p.T  # [d_mlp, d_model] (GPT-2 Conv1D is transposed)
                rows[i] = 3.0 * direction
            elif p.shape[0] == lm.info.d_mlp:
                p[i] = 0.0
    pos = ["zebra the cat sat", "a zebra ran away", "the zebra ate grass", "zebra zebra"]
    neg = ["the cat sat down", "a dog ran away", "the cow ate grass", "hello there"]
    pooled = relations.pooled_activations(lm, pos + neg, progress=False)
    ap = relations.ap_scores(pooled, ["pos"] * 4 + ["neg"] * 4, ["pos", "neg"])
    assert ap[0, L, i] == pytest.approx(1.0)
    assert (L, i) in set(map(tuple, relations.top_neurons(ap[0], 5).tolist()))
    # zeroing it at every position changes the output (it fires strongly on the marker)
    enc = hooks.encode(lm, ["zebra"])
    with torch.no_grad():
        base = lm.model(**enc)[0]
        with hooks.intervene(lm, relations.zero_edits([[L, i]])):
            off = lm.model(**enc)[0]
        with hooks.intervene(lm, relations.zero_edits(relations.random_neurons([[L, i]], lm.info.n_layers, lm.info.d_mlp)[:0])):
            same = lm.model(**enc)[0]
    assert not torch.allclose(base, off)
    torch.testing.assert_close(base, same)


def test_evaluate_reports_greedy_recall_and_rank():
    lm = models.tiny_random("llama")
    gen = metrics.generate(lm, ["the cat", "a dog sat"], max_new_tokens=3, progress=False)
    golds = [gen.continuations[0], "zzzz nothing"]
    df = relations.greedy_recall(lm, ["the cat", "a dog sat"], golds, max_new_tokens=3)
    assert df["correct"].tolist() == [relations.is_correct(gen.continuations[0], golds[0]), False]
    first = gen.new_ids[0][0]
    assert df.loc[0, "rank"] == (0 if relations.gold_first_token(lm, golds[0]) == first else df.loc[0, "rank"])
    # the rank matches a plain forward pass
    enc = hooks.encode(lm, ["a dog sat"])
    with torch.no_grad():
        logits = lm.model(**enc).logits[0, -1]
    t = relations.gold_first_token(lm, golds[1])
    assert df.loc[1, "rank"] == int((logits > logits[t]).sum())
    assert df["logprob"].le(0).all()
    off = relations.greedy_recall(lm, ["the cat", "a dog sat"], golds, off=[[0, i] for i in range(lm.info.d_mlp)],
                             max_new_tokens=3)
    assert len(off) == 2
