"""SAOBP refinement and attention statistics (lib.papers.saobp) and the training toolkit (lib.papers.saobp.scratch), checked on
tiny random models and by hand."""
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

from lib import hooks, metrics, models
from lib.papers import saobp
from lib.papers.saobp import scratch
from lib.infra import repro, store

PAD_TEXTS = ["the cat sat on the mat today", "a b", "hello there my friend"]


@pytest.fixture(scope="module", params=["bert", "llama", "gpt2", "mistral"])
def tiny_fam(request, device):
    lm = models.tiny_random(request.param)
    lm.model.to(device)
    lm.device = device
    return lm


def _logits(lm, enc):
    enc = {k: v.to(lm.device) for k, v in enc.items()}
    with torch.no_grad():
        return lm.model(**enc)[0]


def _detach(lm):
    saobp.detach(lm)


def test_zero_J_reproduces_the_plain_model(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    plain = _logits(tiny_fam, enc)
    with hooks.attention(tiny_fam):
        eager = _logits(tiny_fam, enc)
    saobp.attach(tiny_fam, J=0.0, mode="free")  # J = 0 exists only in the free mode
    try:
        with saobp.active(tiny_fam):
            refined = _logits(tiny_fam, enc)
        saobp.get(tiny_fam).theta.data.fill_(-2.0)
        with saobp.active(tiny_fam):
            changed = _logits(tiny_fam, enc)
    finally:
        _detach(tiny_fam)
    assert torch.equal(refined, eager)  # g = 0: M is exactly 0
    real = enc["attention_mask"].bool()  # padding rows differ between attention kernels; compare real tokens
    torch.testing.assert_close(refined[real], plain[real], atol=1e-5, rtol=1e-4)
    assert (changed[real] - plain[real]).abs().max() > 1e-6  # and J != 0 does change the model (little: near-uniform random attention)


def test_refined_rows_are_distributions_that_respect_masks(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    rec = hooks.AttentionRecorder()
    saobp.attach(tiny_fam, J=-3.0)
    try:
        with saobp.active(tiny_fam, capture=rec), torch.no_grad():
            tiny_fam.model(**enc)
    finally:
        _detach(tiny_fam)
    real = enc["attention_mask"].bool().cpu()  # [b, n] (patterns are kept on the CPU)
    for L in range(tiny_fam.info.n_layers):
        A = rec.patterns[L]  # [b, h, n, n]
        rows = A.sum(-1)[real[:, None, :].expand(-1, A.shape[1], -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows))
        pad_keys = ~real[:, None, None, :].expand_as(A) & real[:, None, :, None].expand_as(A)
        assert A[pad_keys].abs().max() == 0  # padding keys get no weight from real queries
        if tiny_fam.info.is_causal:
            future = A.triu(1) * real[:, None, :, None]  # real queries (padding rows are fully masked)
            assert future.abs().max() == 0  # no weight on future keys


def messages_loop(scores: torch.Tensor, valid: torch.Tensor | None, J: float) -> torch.Tensor:
    """The reference: saobp.messages' M written as the slow obvious loop, one (batch row, head, i, j) at a time."""
    A = torch.softmax(scores.float(), -1) if valid is None else torch.softmax(scores.float(), -1).masked_fill(~valid, 0.0)
    b, h, n, _ = A.shape
    g = math.expm1(J)
    M = torch.zeros_like(A)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                for j in range(n):
                    s = 0.0
                    for kk in range(n):
                        key_ok = True if valid is None else bool(valid[bi, 0, i, kk])
                        if kk != i and key_ok:
                            s += float(A[bi, hi, i, kk]) * math.log(1 + g * float(A[bi, hi, kk, j]))
                    M[bi, hi, i, j] = s
    return M


def test_messages_match_the_slow_loop():
    torch.manual_seed(0)
    S = torch.randn(2, 3, 5, 5) * 2
    valid = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    valid[1, :, :, 3:] = False  # sequence 1: keys 3, 4 are padding
    S = S.masked_fill(~valid, torch.finfo(S.dtype).min)
    for J in (0.0, -0.7, -3.0):
        torch.testing.assert_close(saobp.messages(S, valid, J), messages_loop(S, valid, J), atol=1e-5, rtol=1e-5)
    # first order in g: M ~ g * (A~ A)
    A = torch.softmax(S, -1).masked_fill(~valid, 0)
    g = math.expm1(-1e-3)
    first = g * (A.masked_fill(torch.eye(5, dtype=torch.bool), 0) @ A)
    torch.testing.assert_close(saobp.messages(S, valid, -1e-3), first, atol=1e-6, rtol=1e-3)
    assert (saobp.messages(S, valid, -2.0) <= 0).all() and (saobp.messages(S, valid, -2.0) >= -2.0 - 1e-6).all()


def test_per_head_J_and_square_requirement():
    S = torch.randn(1, 2, 4, 4)
    M = saobp.messages(S, None, torch.tensor([0.0, -1.0]))
    assert M[0, 0].abs().max() == 0 and M[0, 1].abs().max() > 0
    with pytest.raises(ValueError, match="square"):
        saobp.messages(torch.randn(1, 2, 1, 4), None, -1.0)
    with pytest.raises(ValueError, match="one value per head"):
        saobp.messages(S, None, torch.zeros(3))


def test_gtd_2hop_on_hand_made_patterns():
    n = 6
    eye = torch.eye(n)[None, None]
    uniform = torch.full((1, 1, n, n), 1 / n)
    hub = torch.zeros(1, 1, n, n)
    hub[..., 2] = 1.0
    chain = torch.zeros(1, 1, n, n)
    for i in range(n - 1):
        chain[0, 0, i, i + 1] = 1.0
    chain[0, 0, n - 1, n - 1] = 1.0
    for A in (eye, uniform, hub):
        assert saobp.gtd_2hop(A).abs().max() < 1e-6
    torch.testing.assert_close(saobp.gtd_2hop(chain), torch.tensor([[(n - 2) / n]]))
    # padding queries do not count: the chain on 4 real tokens of 6
    valid = torch.zeros(1, 1, n, n, dtype=torch.bool)
    valid[..., :4] = True
    valid[0, 0, 4:, :] = False
    c4 = torch.zeros(1, 1, n, n)
    for i in range(3):
        c4[0, 0, i, i + 1] = 1.0
    c4[0, 0, 3, 3] = 1.0
    torch.testing.assert_close(saobp.gtd_2hop(c4, valid), torch.tensor([[2 / 4]]))


def test_gtd_msg_is_zero_at_g_zero_and_a_fraction_otherwise():
    torch.manual_seed(1)
    S = torch.randn(2, 3, 5, 5)
    for J, lo, hi in ((0.0, 0.0, 0.0), (-2.0, 1e-4, 1.0)):
        M = saobp.messages(S, None, J)
        v = saobp.gtd_msg(S, M, None)
        assert v.shape == (2, 3) and (v >= lo).all() and (v <= hi).all()
    # a row constant does not change S_c (softmax ignores it)
    M = saobp.messages(S, None, -1.0)
    torch.testing.assert_close(saobp.gtd_msg(S + 5.0, M, None), saobp.gtd_msg(S, M, None))


def test_attention_stats_match_the_metrics_function(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    rec = hooks.AttentionRecorder()
    with hooks.attention(tiny_fam, capture=rec), torch.no_grad():
        tiny_fam.model(**enc)
    stats = saobp.attention_stats(tiny_fam, dict(enc), batch_size=2)
    qm = enc["attention_mask"].bool()
    for L in range(tiny_fam.info.n_layers):
        raw, norm = metrics.attention_entropy(rec.patterns[L], rec.valid[L], qm)
        torch.testing.assert_close(stats.per_head("entropy")[L].float(), raw.mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.per_head("entropy_norm")[L].float(), norm.mean(0), atol=1e-5, rtol=1e-5)
    tab = stats.table()
    assert list(tab.columns) == ["entropy", "entropy_norm", "gtd_2hop", "gtd_msg", "sink_mass", "entropy_norm_nosink",
                                 "collapsed_frac"]
    assert tab["gtd_msg"].isna().all()  # no SAOBP attached: no messages
    assert tab["sink_mass"].between(0, 1).all() and tab["entropy_norm_nosink"].between(0, 1 + 1e-6).all()


def test_thirds_and_depth_fall():
    assert saobp.thirds(6) == ([0, 1], [4, 5]) and saobp.thirds(1) == ([0], [0]) and saobp.thirds(30)[1][0] == 20
    assert saobp.depth_fall([0.9, 0.8, 0.5, 0.4, 0.2, 0.1]) == pytest.approx(0.15 - 0.85)
    assert saobp.depth_fall([0.7]) == 0.0  # one layer: nothing to compare
    np.testing.assert_allclose(saobp.depth_fall(np.array([[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]])), [-1.0, 1.0])


def test_without_sink_drops_the_first_visible_key_and_renormalises():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.0, 0.5, 0.25, 0.25]]).reshape(2, 1, 1, 4)
    valid = torch.tensor([[True, True, True, False], [False, True, True, True]]).reshape(2, 1, 1, 4)  # row 2 left-padded
    mass, rest, v2 = saobp.without_sink(probs, valid)
    torch.testing.assert_close(mass.flatten(), torch.tensor([0.7, 0.5]))
    torch.testing.assert_close(rest.reshape(2, 4), torch.tensor([[0.0, 2 / 3, 1 / 3, 0.0], [0.0, 0.0, 0.5, 0.5]]))
    assert v2.reshape(2, 4).tolist() == [[False, True, True, False], [False, False, True, True]]
    # planted: a sink with 90% of the mass and a uniform rest has low entropy, and none once the sink is removed
    p = torch.tensor([0.9] + [0.1 / 7] * 7).reshape(1, 1, 1, 8)
    _, norm = metrics.attention_entropy(p)
    _, norm_rest = metrics.attention_entropy(*saobp.without_sink(p, None)[1:])
    assert norm.item() < 0.3 and norm_rest.item() == pytest.approx(1.0)


def test_learnable_J_gets_gradients_and_fixed_J_does_not(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    with torch.enable_grad():
        mod = saobp.attach(tiny_fam, J=-1.0, learnable=True)
        try:
            with saobp.active(tiny_fam):
                out = tiny_fam.model(**enc)[0]
            out.pow(2).mean().backward()
            assert mod.theta.grad is not None and mod.theta.grad.abs().sum() > 0
            assert saobp.get(tiny_fam) is mod and not any("saobp" in k for k in tiny_fam.model.state_dict())
        finally:
            _detach(tiny_fam)
            tiny_fam.model.zero_grad(set_to_none=True)
        fixed = saobp.attach(tiny_fam, J=-1.0, learnable=False)
        try:
            assert not fixed.theta.requires_grad and not fixed.J.requires_grad
        finally:
            _detach(tiny_fam)


def test_synthetic_multihop_answer_needs_two_hops():
    df = scratch.synthetic_multihop(50, seed=3)
    for text, label in zip(df["text_a"], df["label"]):
        knows = dict(re.findall(r"(\w+) knows (\w+) \.", text))
        likes = dict(re.findall(r"(\w+) likes (\w+) \.", text))
        x = re.search(r"friend of (\w+) like", text).group(1)
        assert likes[knows[x]] == scratch.COLOURS[label]
        assert x not in likes  # one hop from the queried name reaches no colour
    assert df.equals(scratch.synthetic_multihop(50, seed=3))


def test_small_models_train_and_evaluate():
    tok = models.tiny_random("bert").tokenizer
    df = scratch.synthetic_multihop(64, seed=0)
    raw = scratch.encode_classification(tok, df, 40)
    vocab = scratch.compact_vocab(tok, raw["input_ids"].tolist(), 50)
    assert vocab(raw["input_ids"]).max() < vocab.size and vocab.pad == 0
    enc = scratch.encode_classification(tok, df, 40, vocab)
    clf = scratch.small_model("bert", 1, 32, vocab, tok, num_labels=8, saobp="learnable")
    J0 = saobp.get(clf).J.detach().clone()
    with torch.enable_grad():
        log = scratch.train(clf, enc, steps=3, batch_size=8, seed=0)
    assert len(log.losses) == 3 and not torch.equal(J0, saobp.get(clf).J.detach())
    acc = scratch.accuracy_or_perplexity(clf, enc)["accuracy"]
    assert 0.0 <= acc <= 1.0
    lm_enc = scratch.encode_lm(tok, df["text_a"].tolist()[:20], 16, vocab)
    assert lm_enc["input_ids"].shape[1] == 16
    lm = scratch.small_model("llama", 1, 32, vocab, tok, saobp="fixed", J=-1.0)
    with torch.enable_grad():
        scratch.train(lm, lm_enc, steps=2, batch_size=4)
    torch.testing.assert_close(saobp.get(lm).J.detach(), torch.full_like(saobp.get(lm).J, -1.0))
    ppl = scratch.accuracy_or_perplexity(lm, lm_enc)["perplexity"]
    assert 1.0 < ppl < 10 * vocab.size
    with pytest.raises(RuntimeError, match="autograd"):
        with torch.no_grad():
            scratch.train(lm, lm_enc, steps=1)


def test_matched_length_and_shuffled_tokens():
    tok = models.tiny_random("bert").tokenizer
    df = pd.DataFrame({"text_a": ["a b c d e f g h", "a b", "h g f e d c b a x y", "c d e f g h a b"], "text_b": None, "label": 0})
    enc = scratch.encode_matched(tok, df, 6, n=2)
    assert enc["input_ids"].shape == (2, 6) and bool((enc["attention_mask"] == 1).all())
    assert enc["labels"].tolist() == [0, 0]  # rows 0 and 2: 'a b' is too short
    sh = scratch.shuffle_tokens(enc, tok.all_special_ids, seed=0)
    assert torch.equal(sh["input_ids"][:, [0, -1]], enc["input_ids"][:, [0, -1]])  # [CLS] ... [SEP] in place
    assert all(sorted(a.tolist()) == sorted(b.tolist()) for a, b in zip(sh["input_ids"], enc["input_ids"]))  # same tokens
    assert not torch.equal(sh["input_ids"], enc["input_ids"])  # order changed
    assert torch.equal(sh["input_ids"], scratch.shuffle_tokens(enc, tok.all_special_ids, seed=0)["input_ids"])


def test_training_curve_probe_leaves_the_training_unchanged():
    tok = models.tiny_random("bert").tokenizer
    df = scratch.synthetic_multihop(48, seed=0)
    vocab = scratch.compact_vocab(tok, scratch.encode_classification(tok, df, 32)["input_ids"].tolist(), 50)
    enc = scratch.encode_lm(tok, df["text_a"].tolist(), 16, vocab)
    logs = []
    for probe_every in (0, 2):
        repro.setup(0, grad=True)
        lm = scratch.small_model("llama", 2, 32, vocab, tok, seed=0, saobp="learnable", J=-1.0)
        logs.append(scratch.train(lm, enc, steps=5, batch_size=4, seed=0, probe={k: v[:6] for k, v in enc.items()},
                                  probe_every=probe_every))
        torch.set_grad_enabled(False)
    assert logs[0].losses == logs[1].losses  # the probe draws no random numbers and runs without dropout
    assert logs[0].curve == [] and [c["step"] for c in logs[1].curve] == [0, 2, 4, 5]
    assert all(len(c["entropy_norm"]) == 2 and all(0 <= x <= 1 for x in c["sink_mass"]) for c in logs[1].curve)
    assert all(len(c["entropy_norm_nosink"]) == 2 and all(0 <= x <= 1 for x in c["entropy_norm_nosink"]) for c in logs[1].curve)


def test_unigram_perplexity_and_size_order():
    train_enc = {"input_ids": torch.tensor([[0, 0, 0, 1]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    dev_enc = {"labels": torch.tensor([[2, 0, 1]])}  # targets 0 and 1 (the first position predicts nothing)
    p = torch.tensor([4.0, 2.0, 1.0]) / 7  # add-one counts over a vocabulary of 3
    assert scratch.unigram_perplexity(train_enc, dev_enc, 3) == pytest.approx(float(torch.exp(-(p[0].log() + p[1].log()) / 2)))
    assert scratch.size_order(["small", "tiny", "narrow", "mini"]) == ["mini", "narrow", "tiny", "small"]


# ----------------------------------------------------------------------------- repulsive by construction


def _push_J_up(mod: saobp.SAOBP, steps: int = 50, lr: float = 0.5) -> list[float]:
    """Adam steps on a loss that rewards a larger J (loss = -sum J); returns the largest J after each."""
    opt = torch.optim.Adam([mod.theta], lr=lr)
    top = []
    with torch.enable_grad():
        for _ in range(steps):
            loss = -mod.J.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            top.append(float(mod.J.detach().max()))
    return top


def test_repulsive_J_stays_negative_when_pushed_up_and_free_J_turns_positive():
    rep = saobp.SAOBP(2, 3, J=-0.5)
    assert rep.mode == "repulsive"  # the default
    torch.testing.assert_close(rep.J.detach(), torch.full((2, 3), -0.5))
    top = _push_J_up(rep)
    assert top[-1] > -0.05  # it did move up, towards the plain model ...
    assert all(t < 0 for t in top) and (rep.J.detach() < 0).all()  # ... and never reached J >= 0
    free = saobp.SAOBP(2, 3, J=-0.5, mode="free")
    _push_J_up(free)
    assert (free.J.detach() > 0).all()  # the unconstrained variant turns attractive
    assert free.J is free.theta  # free: J is the parameter itself


def test_repulsive_J_stays_negative_through_training_a_model():
    tok = models.tiny_random("bert").tokenizer
    df = scratch.synthetic_multihop(32, seed=0)
    raw = scratch.encode_classification(tok, df, 40)
    vocab = scratch.compact_vocab(tok, raw["input_ids"].tolist(), 50)
    enc = scratch.encode_classification(tok, df, 40, vocab)
    clf = scratch.small_model("bert", 1, 32, vocab, tok, num_labels=8, saobp="learnable", J=-1e-3)
    with torch.enable_grad():
        scratch.train(clf, enc, steps=5, batch_size=8, seed=0, j_lr=5.0)  # a huge step size for J
    assert (saobp.get(clf).J.detach() < 0).all()


def test_initial_J_per_head_and_per_layer_and_head():
    mod = saobp.SAOBP(2, 3, J=torch.tensor([-1.0, -2.0, -4.0]))
    torch.testing.assert_close(mod.J.detach(), torch.tensor([[-1.0, -2.0, -4.0]] * 2))
    full = -torch.arange(1, 7, dtype=torch.float32).view(2, 3)
    torch.testing.assert_close(saobp.SAOBP(2, 3, J=full).J.detach(), full)
    torch.testing.assert_close(saobp.SAOBP(2, 3, J=0.5, mode="free").J.detach(), torch.full((2, 3), 0.5))
    torch.testing.assert_close(saobp.SAOBP(2, 3).J.detach(), torch.full((2, 3), saobp.DEFAULT_J))


@pytest.mark.parametrize("J", [0.0, 0.3, [-1.0, 0.0, -1.0]])
def test_repulsive_mode_rejects_J_at_or_above_zero(J):
    with pytest.raises(ValueError, match="J < 0.*mode='free'"):
        saobp.SAOBP(2, 3, J=torch.tensor(J))


def test_invalid_modes_and_shapes_raise():
    with pytest.raises(ValueError, match="unknown SAOBP mode 'attractive'"):
        saobp.SAOBP(2, 3, J=-1.0, mode="attractive")
    with pytest.raises(ValueError, match="one value per head"):
        saobp.SAOBP(2, 3, J=torch.full((4,), -1.0))
    with pytest.raises(ValueError, match="finite"):
        saobp.SAOBP(2, 3, J=float("nan"), mode="free")
    lm = models.tiny_random("bert")
    with pytest.raises(ValueError, match="J < 0"):
        saobp.attach(lm, J=0.0)
    assert saobp.get(lm) is None  # nothing attached after a refused J
    tok = lm.tokenizer
    vocab = scratch.compact_vocab(tok, [[5, 6, 7]], 3)
    with pytest.raises(ValueError, match="J < 0"):
        scratch.small_model("bert", 1, 32, vocab, tok, num_labels=2, saobp="learnable", J=0.0)
    with pytest.raises(ValueError, match="unknown j_mode"):
        scratch.scratch_run("SST-2", "mini", 0, "saobp", steps=1, j_mode="attractive")
    with pytest.raises(ValueError, match="J < 0"):
        scratch.scratch_run("SST-2", "mini", 0, "saobp", steps=1, J=0.0)



def test_notebook_10_defaults_are_the_shared_lm_recipe():
    """07 trains the baselines of scratch.LM_RECIPE and 10 reuses them from the cache: 10's parameter
    defaults must be that recipe, or 07 would show other models than 10 compares."""
    from lib.infra import params

    spec = params._parameters("10_saobp_small_scale_gains")
    for k in ("steps", "batch_size", "max_length", "lr", "vocab_size", "curve_every"):
        assert spec[k][1] == scratch.LM_RECIPE[k], k
    assert spec["tasks"][1] == [scratch.LM_RECIPE["task"]]
    spec07 = params._parameters("07_attention_entropy_collapse")
    assert set(spec07["scratch_sizes"][1]) == set(spec["sizes"][1])
    # finding 2's setting is 07's confirmed one: the same size and fresh seeds, none of them an exploration seed
    assert spec["collapse_size"][1] == spec07["collapse_size"][1]
    assert spec["collapse_seeds"][1] == spec07["confirm_seeds"][1]
    assert not set(spec["collapse_seeds"][1]) & set(scratch.COLLAPSE_SEARCH["seeds"])


def test_collapse_search_picks_the_cheapest_setting_where_every_seed_collapses_without_the_sink(monkeypatch):
    """A planted search: fake runs whose curves fall where the test says. The rule takes the cheapest (layers x steps)
    setting in which every exploration seed falls by at least 0.05 with and without the sink; a fall that is only
    sink growth (present with the sink, gone without it), or that one seed lacks, does not qualify."""
    cs = scratch.COLLAPSE_SEARCH

    def fake_runs(plant):
        def runs(configs, progress=False, desc=""):
            out = []
            for c in configs:
                L = scratch.SIZES[c["size"]][0]
                curve = []
                for step in range(0, cs["steps"] + 1, cs["curve_every"]):
                    fall, fall_ns = plant(c["size"], c["seed"], step)
                    first = [0.5] * (L - len(saobp.thirds(L)[1]))
                    curve.append({"step": step, "entropy_norm": first + [0.5 + fall] * len(saobp.thirds(L)[1]),
                                  "entropy_norm_nosink": first + [0.5 + fall_ns] * len(saobp.thirds(L)[1])})
                out.append({"curve": curve})
            return out
        return runs

    small, big = cs["sizes"][0], cs["sizes"][-1]
    # the small size collapses from 800 steps on, the big one from 400: the rule takes whichever costs fewer layers x steps
    monkeypatch.setattr(scratch, "scratch_runs", fake_runs(
        lambda size, seed, step: ((-0.1, -0.1) if (size == small and step >= 800) or (size == big and step >= 400) else (0.0, 0.0))))
    table, choice = scratch.collapse_search()
    cost = {(small, 800): scratch.SIZES[small][0] * 800, (big, 400): scratch.SIZES[big][0] * 400}
    assert choice == min(cost, key=cost.get)
    assert set(table["steps"]) == set(cs["at"]) and set(table["seed"]) == set(cs["seeds"])
    # sink growth only: falls with the sink, not without it -> nothing qualifies
    monkeypatch.setattr(scratch, "scratch_runs", fake_runs(lambda size, seed, step: (-0.1, 0.0)))
    assert scratch.collapse_search()[1] is None
    # one exploration seed never falls -> nothing qualifies
    monkeypatch.setattr(scratch, "scratch_runs", fake_runs(
        lambda size, seed, step: (0.02, 0.02) if seed == cs["seeds"][-1] else (-0.2, -0.2)))
    assert scratch.collapse_search()[1] is None


def test_scratch_runs_in_worker_processes_give_the_same_runs(tmp_path, monkeypatch):
    """Two workers and one process build the same numbers (every run trains on one thread), cached
    runs are not built again, and bad worker counts raise."""
    from lib.infra import paths

    configs = [dict(task="LM", size="mini", seed=s, variant=v, steps=2, n_stats=4, n_eval=8, vocab_size=50)
               for s, v in ((0, "baseline"), (0, "saobp"))]
    out = {}
    models_dir = paths.CACHE / "models"  # the prepared embedded models, shared (converting them again takes a minute)
    for workers in (2, 1):
        cache_dir = tmp_path / f"cache{workers}"
        if models_dir.is_dir():
            cache_dir.mkdir()
            (cache_dir / "models").symlink_to(models_dir, target_is_directory=True)
        monkeypatch.setenv("COMPENDIUM_CACHE", str(cache_dir))  # the workers read it at import
        monkeypatch.setattr(paths, "CACHE", cache_dir)
        monkeypatch.setenv(store.STORE_ENV, str(tmp_path / f"store{workers}"))  # each way its own records
        out[workers] = scratch.scratch_runs(configs, workers=workers)
        assert all(scratch.scratch_run(**c, where=True) for c in configs)  # every run's record written
    for a, b in zip(out[2], out[1]):
        assert a["losses"] == b["losses"] and a["metrics"] == b["metrics"]
        pd.testing.assert_frame_equal(a["table"], b["table"])
    assert scratch.scratch_runs(configs, workers=2)[0]["losses"] == out[1][0]["losses"]  # from the cache
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        scratch.scratch_runs(configs, workers=0)
