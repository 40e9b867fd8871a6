"""lib.papers.dpo.neurons against slow, obvious loops on tiny random decoders of every family."""
import copy

import numpy as np
import pytest
import torch

from lib import hooks, models
from lib.infra import cache
from lib.papers.dpo import neurons as dn


@pytest.fixture(scope="module")
def pair(tiny_decoder):
    """The tiny model and a 'fine-tuned' copy with perturbed W_out (different value vectors)."""
    tuned = copy.copy(tiny_decoder)
    tuned.model = copy.deepcopy(tiny_decoder.model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for L in range(tuned.info.n_layers):
            w = tuned.mlp_out_module(L).weight
            w.add_(0.05 * torch.randn(w.shape, generator=g).to(w.device))
    return tiny_decoder, tuned


@pytest.fixture(scope="module")
def direction(tiny_decoder):
    return torch.randn(tiny_decoder.info.d_model, generator=torch.Generator().manual_seed(2))


def _means(loaded, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(loaded.info.n_layers, loaded.info.d_mlp, generator=g)


def test_projections_cosines_deltas_match_loops(pair, direction):
    base, tuned = pair
    mb, mt = _means(base, 3), _means(base, 4)
    cos = dn.neuron_cosines(base, direction)
    pb = dn.neuron_projections(base, mb, direction)
    delta = dn.projection_deltas(base, tuned, mb, mt, direction)
    w = direction / direction.norm()
    for L in range(base.info.n_layers):
        vb, vt = hooks.value_vectors(base, L).cpu(), hooks.value_vectors(tuned, L).cpu()  # [d_mlp, d_model]
        for i in range(0, base.info.d_mlp, 5):
            c = float(vb[i] @ direction) / (float(vb[i].norm()) * float(direction.norm()))
            assert abs(float(cos[L, i]) - c) < 1e-5
            p_b = float(mb[L, i]) * float(vb[i] @ w)
            p_t = float(mt[L, i]) * float(vt[i] @ w)
            assert abs(float(pb[L, i]) - p_b) < 1e-5
            assert abs(float(delta[L, i]) - (p_b - p_t)) < 1e-5
    # same model, same means: no change anywhere
    assert float(dn.projection_deltas(base, base, mb, mb, direction).abs().max()) == 0
    with pytest.raises(ValueError, match="non-zero"):
        dn.neuron_cosines(base, torch.zeros_like(direction))
    with pytest.raises(ValueError, match="shape"):
        dn.neuron_projections(base, mb[:, :3], direction)


def test_groups_and_shares(pair, direction):
    base, tuned = pair
    mb, mt = _means(base, 3), _means(base, 4)
    cos = dn.neuron_cosines(base, direction)
    delta = dn.projection_deltas(base, tuned, mb, mt, direction)
    groups = dn.neuron_groups(cos, mb, delta > 0)
    expected = {}
    for L in range(base.info.n_layers):
        for i in range(base.info.d_mlp):
            if delta[L, i] <= 0:
                assert groups[L, i] == ""
                continue
            g = ("T" if cos[L, i] > 0 else "A") + ("P" if mb[L, i] > 0 else "N")
            assert groups[L, i] == g
            expected[g] = expected.get(g, 0.0) + float(delta[L, i])
    shares = dn.group_shares(delta, cos, mb)
    assert list(shares.group) == list(dn.GROUPS)
    assert abs(shares.share.sum() - 1) < 1e-6
    total = float(delta[delta > 0].sum())
    for row in shares.itertuples():
        assert abs(row.share - expected.get(row.group, 0.0) / total) < 1e-5
    assert shares["count"].sum() == int((delta > 0).sum())
    frame = dn.neuron_frame(base, tuned, mb, mt, direction)
    assert len(frame) == base.info.n_layers * base.info.d_mlp
    assert (frame.group != "").sum() == int((delta > 0).sum())
    np.testing.assert_allclose(frame.delta.to_numpy(), delta.flatten().numpy(), atol=1e-6)


def test_top_neurons_and_positive_share(tiny_decoder, direction):
    cos = dn.neuron_cosines(tiny_decoder, direction)
    top = dn.top_toxic_neurons(cos, 10)
    assert len(top) == 10 and len(set(top)) == 10
    vals = [float(cos[L, i]) for L, i in top]
    assert vals == sorted(vals, reverse=True)
    assert min(vals) >= float(cos.flatten().sort(descending=True).values[9])
    delta = torch.randn(cos.shape, generator=torch.Generator().manual_seed(5))
    by_loop = sum(max(float(delta[L, i]), 0.0) for L, i in top) / float(delta.clamp_min(0).sum())
    assert abs(dn.positive_share(delta, top) - by_loop) < 1e-6
    everyone = [(L, i) for L in range(cos.shape[0]) for i in range(cos.shape[1])]
    assert abs(dn.positive_share(delta, everyone) - 1) < 1e-6
    assert dn.positive_share(delta, []) == 0.0
    with pytest.raises(ValueError, match="integer"):
        dn.top_toxic_neurons(cos, 0)


def _observed(loaded, enc):
    """[n_layers, d_mlp] activation of a one-token input, read the slow way (one hook per layer)."""
    seen = {}
    hs = [loaded.mlp_out_module(L).register_forward_pre_hook(
        lambda m, a, L=L: seen.__setitem__(L, a[0].detach()[0, -1].float().cpu())) for L in range(loaded.info.n_layers)]
    try:
        with torch.no_grad():
            logits = loaded.model(**enc).logits
    finally:
        for h in hs:
            h.remove()
    return torch.stack([seen[L] for L in range(loaded.info.n_layers)]), logits


def test_patch_with_own_means_on_one_token_changes_nothing(tiny_decoder):
    enc = hooks.encode(tiny_decoder, ["the"])
    enc = {k: v[:, -1:] for k, v in enc.items()}  # exactly one token
    own, ref = _observed(tiny_decoder, enc)
    neurons = [(L, i) for L in range(tiny_decoder.info.n_layers) for i in range(0, tiny_decoder.info.d_mlp, 3)]
    table = dn.patch_table(neurons, own)
    assert list(table.columns) == ["layer", "neuron", "mode", "value"] and len(table) == len(neurons)
    assert set(table["mode"]) == {"set"}
    with hooks.intervene(tiny_decoder, table), torch.no_grad():
        torch.testing.assert_close(tiny_decoder.model(**enc).logits, ref, atol=1e-5, rtol=1e-4)
    with hooks.intervene(tiny_decoder, dn.patch_table(neurons, own + 5.0)), torch.no_grad():
        assert not torch.allclose(tiny_decoder.model(**enc).logits, ref, atol=1e-3)


def test_editing_table_selection_and_identity(tiny_decoder, direction):
    mb = _means(tiny_decoder, 6)
    cos = dn.neuron_cosines(tiny_decoder, direction)
    groups = dn.neuron_groups(cos, mb)
    table = dn.editing_table(mb, cos, alpha=0.2, beta=0.5, how="scale")
    assigned = dn.editing_table(mb, cos, alpha=0.2, beta=0.5)  # the authors' method: mean * (1 -/+ alpha)
    assert assigned[["layer", "neuron", "group"]].equals(table[["layer", "neuron", "group"]])
    assert (assigned["mode"] == "set").all() and (table["mode"] == "scale").all()
    want_values = [float(mb[L, i]) * v for L, i, v in zip(table.layer, table.neuron, table.value)]
    assert np.allclose(assigned.value, want_values)
    for g in dn.GROUPS:
        members = [(L, i) for L, i in zip(*np.nonzero(groups == g))]
        got = table[table.group == g]
        assert len(got) == int(round(0.5 * len(members)))
        # slow way: sort the members by |cos| and take the first half from the chosen end
        ranked = sorted(members, key=lambda li: abs(float(cos[li])), reverse=dn.EDIT_KEEP[g] == "highest")
        want = set((int(L), int(i)) for L, i in ranked[:len(got)])
        assert set(zip(got.layer, got.neuron)) == want
        assert np.allclose(got.value, 1 - 0.2 if g in ("TP", "AN") else 1 + 0.2)
    assert len(dn.editing_table(mb, cos, 0.2, 1.0)) == int((groups != "").sum())
    # keep='random': the same number per group, drawn at random (seeded), a matched random-neuron control
    rand = dn.editing_table(mb, cos, 0.2, 0.5, keep={g: "random" for g in dn.GROUPS}, seed=3)
    assert rand.group.value_counts().to_dict() == table.group.value_counts().to_dict()
    assert rand.equals(dn.editing_table(mb, cos, 0.2, 0.5, keep={g: "random" for g in dn.GROUPS}, seed=3))
    assert not rand[["layer", "neuron"]].equals(table[["layer", "neuron"]])
    with pytest.raises(ValueError, match="how"):
        dn.editing_table(mb, cos, 0.2, 0.5, how="shift")
    assert len(dn.editing_table(mb, cos, 0.2, 0.0)) == 0
    # alpha = 0 scales every kept neuron by 1: the model's output is unchanged
    enc = hooks.encode(tiny_decoder, ["some text to edit", "and more"])
    with torch.no_grad():
        ref = tiny_decoder.model(**enc).logits
        with hooks.intervene(tiny_decoder, dn.editing_table(mb, cos, 0.0, 1.0, how="scale")[["layer", "neuron", "mode", "value"]]):
            torch.testing.assert_close(tiny_decoder.model(**enc).logits, ref)
        with hooks.intervene(tiny_decoder, dn.editing_table(mb, cos, 0.5, 1.0)):
            assert not torch.allclose(tiny_decoder.model(**enc).logits, ref)
    with pytest.raises(ValueError, match="alpha"):
        dn.editing_table(mb, cos, 1.5, 0.5)


def test_group_neurons_and_reduction_share():
    groups = np.array([["TP", "", "AN"], ["AP", "TP", "TN"]])
    assert dn.group_neurons(groups, ["TP"]) == [(0, 0), (1, 1)]
    assert dn.group_neurons(groups, ["TP", "AN"]) == [(0, 0), (0, 2), (1, 1)]
    with pytest.raises(ValueError, match="group"):
        dn.group_neurons(groups, ["XX"])
    assert dn.reduction_share(0.4, 0.3, 0.2) == pytest.approx(0.5)
    assert np.isnan(dn.reduction_share(0.2, 0.1, 0.3))


def test_generation_stats_and_cached_pair_stats(pair, tmp_path, monkeypatch):
    base, tuned = pair
    monkeypatch.setattr(cache.paths, "CACHE", tmp_path)
    prompts = ["the cat sat on", "hello there my", "one two"]
    stats, gen = dn.generation_stats(base, prompts, max_new_tokens=4, k=3, batch_size=2, progress=False)
    # slow way: the last 3 tokens of each text, one text at a time
    per_text = []
    for text in gen.full_texts:
        enc = hooks.encode(base, [text])
        s = hooks.mlp_activation_stats(base, [text], positions="last_k", k=3, progress=False)
        per_text.append((s.mean, min(3, enc["input_ids"].shape[1])))
    slow = sum(m * n for m, n in per_text) / sum(n for _, n in per_text)
    torch.testing.assert_close(stats.mean, slow, atol=1e-5, rtol=1e-4)
    out = dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, max_new_tokens=4, k=3, batch_size=2, progress=False)
    torch.testing.assert_close(out["base"], stats.mean, atol=1e-5, rtol=1e-4)
    assert out["tuned"].shape == stats.mean.shape and not torch.allclose(out["tuned"], out["base"])
    assert len(list((tmp_path / "store").rglob("neuron-stats/*.json*"))) == 1  # one record (lib.infra.store)
    again = dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, max_new_tokens=4, k=3, batch_size=2, progress=False)
    assert torch.equal(again["tuned"], out["tuned"])
    # the per-prompt means are not in the record: computed again from its continuations, they average to its means
    weights = torch.tensor([min(3, hooks.encode(base, [t])["input_ids"].shape[1]) for t in gen.full_texts], dtype=torch.float32)
    per = again["base_per_prompt"]
    assert per.shape == (len(prompts), *stats.mean.shape)
    torch.testing.assert_close((per * weights[:, None, None]).sum(0) / weights.sum(), again["base"], atol=1e-5, rtol=1e-4)
    same = dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, max_new_tokens=4, k=3, batch_size=2, progress=False,
                         texts="base")
    assert torch.equal(same["base"], out["base"]) and same["tuned_continuations"] == out["base_continuations"]
    assert same["tuned_per_prompt"].shape == per.shape


def test_reference_evaluations_evaluate_both_models(pair):
    """reference_evaluations passes its keywords to ``evaluate`` for each model; the records are the evaluation's
    own (lib.papers.dpo.toxicity_perplexity_f1 reads and writes the store: tests/test_cache.py)."""
    base, tuned = pair
    calls = []

    def evaluate(lm, n=1, scorer="auto", progress=True):
        calls.append(lm)
        return {"which": "base" if lm is base else "tuned", "n": n}

    first = dn.reference_evaluations("tiny", base, tuned, {"steps": 1}, evaluate, n=2, scorer="profanity-check")
    assert first == {"base": {"which": "base", "n": 2}, "tuned": {"which": "tuned", "n": 2}} and calls == [base, tuned]


def test_reference_evaluations_key_a_users_prompts_even_without_declared_inputs(pair, tmp_path, monkeypatch):
    """An evaluation function that does not declare its data (no ``.inputs``) still gets a user's
    prompts into the cache key, so two prompt files never share a cached evaluation."""
    base, tuned = pair
    monkeypatch.setattr(cache.paths, "CACHE", tmp_path)
    calls = []

    def evaluate(lm, prompts=(), scorer="auto"):
        calls.append(tuple(prompts))
        return {"prompts": list(prompts)}

    a = dn.reference_evaluations("tiny", base, tuned, {"steps": 1}, evaluate, prompts=["one"], scorer="profanity-check")
    b = dn.reference_evaluations("tiny", base, tuned, {"steps": 1}, evaluate, prompts=["two"], scorer="profanity-check")
    assert a["base"] == {"prompts": ["one"]} and b["base"] == {"prompts": ["two"]} and len(calls) == 4


def test_same_text_pair_stats(pair, tmp_path, monkeypatch):
    """texts='base': the tuned model read on the base model's texts, measured the slow way; layer 0, before
    any changed weight, then has the base model's activations exactly; an unchanged copy gives the base
    model's means everywhere (a zero change shows none)."""
    base, tuned = pair
    monkeypatch.setattr(cache.paths, "CACHE", tmp_path)
    prompts = ["the cat sat on", "hello there my", "one two"]
    kw = {"max_new_tokens": 4, "k": 3, "batch_size": 2, "progress": False}
    own = dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, **kw)
    same = dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, texts="base", **kw)
    assert own["texts"] == "own" and same["texts"] == "base"
    assert torch.equal(same["base"], own["base"]) and same["tuned_continuations"] == own["base_continuations"]
    read = [p + c for p, c in zip(own["prompts"], own["base_continuations"])]
    slow = hooks.mlp_activation_stats(tuned, read, positions="last_k", k=3, batch_size=1, progress=False)
    torch.testing.assert_close(same["tuned"], slow.mean, atol=1e-5, rtol=1e-4)
    assert same["tuned_per_prompt"].shape == (len(prompts), *own["base"].shape)
    torch.testing.assert_close(same["tuned"][0], same["base"][0], atol=1e-5, rtol=1e-4)  # W_out changed, not layer 0's input
    assert not torch.allclose(same["tuned"][1:], same["base"][1:], atol=1e-4)  # later layers read a changed stream
    assert len(list((tmp_path / "store").rglob("neuron-stats/*.json*"))) == 2  # the own-text record and the same-text one
    twin = copy.copy(base)
    twin.model = copy.deepcopy(base.model)
    zero = dn.pair_stats("tiny", base, twin, {"steps": 0}, prompts, texts="base", **kw)
    torch.testing.assert_close(zero["tuned"], zero["base"], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="texts must be one of"):
        dn.pair_stats("tiny", base, tuned, {"steps": 1}, prompts, texts="tuned", **kw)


def test_group_share_array_matches_group_shares_row_by_row():
    rng = np.random.default_rng(0)
    cos = torch.from_numpy(rng.normal(size=(3, 40))).float()
    cos[0, 0] = 0.0  # in no group
    rows = []
    for _ in range(5):
        delta = torch.from_numpy(rng.normal(size=(3, 40))).float()
        means = torch.from_numpy(rng.normal(size=(3, 40))).float()
        rows.append((delta, means))
    d = np.stack([r[0].flatten().numpy() for r in rows])  # [5, 120]: a batch of resamples
    m = np.stack([r[1].flatten().numpy() for r in rows])
    got = dn.group_share_array(d, cos.flatten().numpy(), m)
    assert got.shape == (5, 4)
    for i, (delta, means) in enumerate(rows):  # each row: its positive Delta summed by neuron_groups' labels
        labels, dd = dn.neuron_groups(cos, means, delta > 0), delta.numpy()
        want = [dd[labels == g].sum() / dd[dd > 0].sum() for g in dn.GROUPS]
        np.testing.assert_allclose(got[i], want, rtol=1e-5)
        np.testing.assert_allclose(dn.group_shares(delta, cos, means).share.to_numpy(), want, rtol=1e-5)
    assert dn.group_share_array(d[None], cos.flatten().numpy(), m[None]).shape == (1, 5, 4)  # any batch axes
    assert np.isnan(dn.group_share_array(-np.abs(d[0]), cos.flatten().numpy(), m[0])).all()  # no Delta > 0
    with pytest.raises(ValueError, match="same shape"):
        dn.group_share_array(d, cos.flatten().numpy(), m[:, :10])


def test_group_asymmetry_finds_dampening_and_strengthening():
    """DPO shrinking every activation lowers only pushes along the direction (TP, AN): asymmetry +1; DPO
    growing every activation strengthens only the pushes against it (TN, AP): -1; the shares' order is GROUPS."""
    rng = np.random.default_rng(0)
    cos, mb = rng.normal(size=200), rng.normal(size=200)
    for scale, want in ((0.5, 1.0), (1.5, -1.0)):
        delta = mb * cos - scale * mb * cos
        assert dn.group_asymmetry(dn.group_share_array(delta, cos, mb)) == pytest.approx(want)
    assert dn.group_asymmetry(np.array([[0.25, 0.25, 0.25, 0.25], [0.4, 0.1, 0.1, 0.4]])) == pytest.approx([0.0, 0.6])
    with pytest.raises(ValueError, match="4 groups"):
        dn.group_asymmetry(np.ones(3))
