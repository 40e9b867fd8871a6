"""SAOBP refinement and attention statistics, checked on tiny random models and by hand."""
import math
import re

import pytest
import torch

from lib import hooks, metrics, models, saobp

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
    if hasattr(lm.model, "saobp"):
        del lm.model.saobp


def test_zero_J_reproduces_the_plain_model(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    plain = _logits(tiny_fam, enc)
    with hooks.attention(tiny_fam):
        eager = _logits(tiny_fam, enc)
    saobp.attach(tiny_fam, J=0.0)
    try:
        with saobp.active(tiny_fam):
            refined = _logits(tiny_fam, enc)
        saobp.get(tiny_fam).J.data.fill_(-2.0)
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


def test_messages_match_the_slow_loop():
    torch.manual_seed(0)
    S = torch.randn(2, 3, 5, 5) * 2
    valid = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    valid[1, :, :, 3:] = False  # sequence 1: keys 3, 4 are padding
    S = S.masked_fill(~valid, torch.finfo(S.dtype).min)
    for J in (0.0, -0.7, -3.0):
        torch.testing.assert_close(saobp.messages(S, valid, J), saobp.messages_loop(S, valid, J), atol=1e-5, rtol=1e-5)
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
    assert list(tab.columns) == ["entropy", "entropy_norm", "gtd_2hop", "gtd_msg", "collapsed_frac"]
    assert tab["gtd_msg"].isna().all()  # no SAOBP attached: no messages


def test_learnable_J_gets_gradients_and_fixed_J_does_not(tiny_fam):
    enc = hooks.encode(tiny_fam, PAD_TEXTS)
    with torch.enable_grad():
        mod = saobp.attach(tiny_fam, J=0.0, learnable=True)
        try:
            with saobp.active(tiny_fam):
                out = tiny_fam.model(**enc)[0]
            out.pow(2).mean().backward()
            assert mod.J.grad is not None and mod.J.grad.abs().sum() > 0
            assert "saobp.J" in tiny_fam.model.state_dict()
        finally:
            _detach(tiny_fam)
            tiny_fam.model.zero_grad(set_to_none=True)
        fixed = saobp.attach(tiny_fam, J=-1.0, learnable=False)
        try:
            assert not fixed.J.requires_grad
        finally:
            _detach(tiny_fam)


def test_synthetic_multihop_answer_needs_two_hops():
    df = saobp.synthetic_multihop(50, seed=3)
    for text, label in zip(df["text_a"], df["label"]):
        knows = dict(re.findall(r"(\w+) knows (\w+) \.", text))
        likes = dict(re.findall(r"(\w+) likes (\w+) \.", text))
        x = re.search(r"friend of (\w+) like", text).group(1)
        assert likes[knows[x]] == saobp.COLOURS[label]
        assert x not in likes  # one hop from the queried name reaches no colour
    assert df.equals(saobp.synthetic_multihop(50, seed=3))


def test_small_models_train_and_evaluate():
    tok = models.tiny_random("bert").tokenizer
    df = saobp.synthetic_multihop(64, seed=0)
    raw = saobp.encode_classification(tok, df, 40)
    vocab = saobp.compact_vocab(tok, raw["input_ids"].tolist(), 50)
    assert vocab(raw["input_ids"]).max() < vocab.size and vocab.pad == 0
    enc = saobp.encode_classification(tok, df, 40, vocab)
    clf = saobp.small_model("bert", 1, 32, vocab, tok, num_labels=8, saobp="learnable")
    J0 = clf.model.saobp.J.detach().clone()
    with torch.enable_grad():
        log = saobp.train(clf, enc, steps=3, batch_size=8, seed=0)
    assert len(log.losses) == 3 and not torch.equal(J0, clf.model.saobp.J.detach())
    acc = saobp.accuracy_or_perplexity(clf, enc)["accuracy"]
    assert 0.0 <= acc <= 1.0
    lm_enc = saobp.encode_lm(tok, df["text_a"].tolist()[:20], 16, vocab)
    assert lm_enc["input_ids"].shape[1] == 16
    lm = saobp.small_model("llama", 1, 32, vocab, tok, saobp="fixed", J=-1.0)
    with torch.enable_grad():
        saobp.train(lm, lm_enc, steps=2, batch_size=4)
    assert lm.model.saobp.J.detach().eq(-1.0).all()
    ppl = saobp.accuracy_or_perplexity(lm, lm_enc)["perplexity"]
    assert 1.0 < ppl < 10 * vocab.size
    with pytest.raises(RuntimeError, match="autograd"):
        with torch.no_grad():
            saobp.train(lm, lm_enc, steps=1)
