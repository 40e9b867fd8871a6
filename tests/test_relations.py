"""Relation-neuron scoring (lib.papers.relations) on tiny random models and hand-made cases; the study as a
whole (setup, answer, facts files) is in test_relation_study.py."""
import numpy as np
import pytest
import torch

from lib import hooks, metrics, models
from lib.papers import dpo, relations


# ----------------------------------------------------------------------------- AP (shared metric)


def _ap_case(rng, trial: int, n_min: int, n_max: int, units: int):
    """Scores [n, units] (tied integers on odd trials, continuous on even ones) and labels with both classes."""
    n = int(rng.integers(n_min, n_max))
    s = rng.integers(0, 3, (n, units)).astype(float) if trial % 2 else rng.normal(size=(n, units))
    y = rng.integers(0, 2, n)
    y[:2] = [1, 0]
    return n, s, y


def test_torch_average_precision_equals_sklearn_with_ties():
    rng = np.random.default_rng(0)
    for trial in range(12):
        n, s, y = _ap_case(rng, trial, 4, 40, 30)
        ref = metrics.average_precision(s, y)
        np.testing.assert_allclose(metrics.average_precision(s, y, backend="torch"), ref, atol=1e-6)
        both = metrics.average_precision(s, np.stack([y, 1 - y], 1), backend="torch")  # [2, units]
        np.testing.assert_allclose(both[0], ref, atol=1e-6)
        np.testing.assert_allclose(both[1], metrics.average_precision(s, 1 - y), atol=1e-6)
    with pytest.raises(ValueError, match="backend"):
        metrics.average_precision(s, y, backend="numpy")


def test_weighted_average_precision_equals_sklearn_and_repeated_rows():
    """Weights are scikit-learn's sample_weight; an integer weight is the row repeated (a bootstrap resample)."""
    rng = np.random.default_rng(3)
    for trial in range(6):
        n, s, y = _ap_case(rng, trial, 6, 30, 20)
        w = rng.integers(0, 4, n).astype(float)
        w[:2] = 1
        ref = metrics.average_precision(s, y, weights=w)
        np.testing.assert_allclose(metrics.average_precision(s, y, backend="torch", weights=w), ref, atol=1e-6)
        rep = np.repeat(np.arange(n), w.astype(int))
        np.testing.assert_allclose(metrics.average_precision(s[rep], y[rep], backend="torch"), ref, atol=1e-6)
    with pytest.raises(ValueError, match="without positives"):
        metrics.average_precision(s, y, backend="torch", weights=np.where(y == 1, 0.0, 1.0))


def test_score_many_counts_a_repeated_row_as_often_as_it_is_listed():
    g = torch.Generator().manual_seed(1)
    pooled = torch.randn(30, 16, generator=g)
    rng = np.random.default_rng(0)
    pos = rng.choice(np.arange(10), 10)  # a bootstrap resample: repeats
    neg = rng.choice(np.arange(10, 30), 20)
    ap, tie = relations.score_many(pooled, [(pos, neg), (np.arange(10), np.arange(10, 30))])
    # the same task with the repeated rows written out as rows of their own
    rows = np.r_[pos, neg]
    ap_rep, tie_rep = relations.score_many(pooled[torch.from_numpy(rows)], [(np.arange(10), np.arange(10, 30))])
    torch.testing.assert_close(ap[0], ap_rep[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(tie[0], tie_rep[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ap[0], ap[1])  # the resample changes the scores


def test_planted_unit_has_ap_one_and_top_of_breaks_ties_by_the_second_score():
    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(40, 48, generator=g)  # [rows, units]
    pos, neg = np.arange(10), np.arange(10, 40)
    pooled[pos, 7] += 10.0  # unit 7 fires on the positives only
    pooled[pos, 30] += 6.0  # unit 30 too, by less: AP 1 as well, a smaller standardised difference
    ap, tie = relations.score_many(pooled, [(pos, neg)])
    assert ap.shape == tie.shape == (1, 48)
    assert ap[0, 7] == pytest.approx(1.0) and ap[0, 30] == pytest.approx(1.0)
    assert relations.top_of(ap[0], tie[0], 2).tolist() == [7, 30]  # not by position (30 would lose to 7 anyway)
    pooled[pos, 3] += 20.0  # an earlier perfect unit with a larger difference comes first
    ap, tie = relations.score_many(pooled, [(pos, neg)])
    assert relations.top_of(ap[0], tie[0], 3).tolist() == [3, 7, 30]
    ref = metrics.average_precision(pooled[:, 11].numpy(), np.r_[np.ones(10), np.zeros(30)].astype(int))
    assert ap[0, 11].item() == pytest.approx(float(np.ravel(ref)[0]), abs=1e-6)
    with pytest.raises(ValueError, match="k must"):
        relations.top_of(ap[0], tie[0], 0)


def test_random_neurons_match_layers_and_exclude_the_set():
    """Paper A's control (01, 03): (layer, neuron) pairs with the same layer counts, none of the set."""
    like = np.array([[1, 0], [1, 1], [1, 2], [3, 5]])
    r = dpo.random_neurons(like, 4, 10, seed=1)
    assert np.bincount(r[:, 0], minlength=4).tolist() == np.bincount(like[:, 0], minlength=4).tolist()
    assert not set(map(tuple, r.tolist())) & set(map(tuple, like.tolist()))
    assert np.array_equal(r, dpo.random_neurons(like, 4, 10, seed=1))
    u = dpo.random_neurons(like, 4, 10, seed=2, match_layers=False)
    assert len(u) == 4 and len(set(map(tuple, u.tolist()))) == 4


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
    units = relations.Units.of(lm, ("act",))
    pooled = relations.answer(lm, pos + neg, ["x"] * 8, n_tokens=1, units=units, record=True).pooled
    ap, tie = relations.score_many(pooled.float(), [(np.arange(4), np.arange(4, 8))])
    flat = L * lm.info.d_mlp + i  # act:L{L}N{i}
    assert units.labels([flat]) == [f"act:L{L}N{i}"]
    assert ap[0, flat] == pytest.approx(1.0)
    assert flat in relations.top_of(ap[0], tie[0], 5).tolist()
    # zeroing it at every position changes the output (it fires strongly on the marker); nothing off changes nothing
    enc = hooks.encode(lm, ["zebra"])
    with torch.no_grad():
        base = lm.model(**enc)[0]
        with relations.zero_units(lm, units, [flat]):
            off = lm.model(**enc)[0]
        with relations.zero_units(lm, units, []):
            same = lm.model(**enc)[0]
    assert not torch.allclose(base, off)
    torch.testing.assert_close(base, same)
