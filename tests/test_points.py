"""hooks.points, the one hook mechanism: named points on every family, checked against hand computation,
Hugging Face's own outputs and (where installed) TransformerLens."""
import importlib.util

import pytest
import torch

from lib import hooks, models
from lib.papers import relations


def _n_hooks(lm):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in lm.model.modules())


def _mlp_by_hand(lm, L, x):
    """The MLP's neurons (its output projection's input) from the MLP's input x, with the weights."""
    f = lm.info.family
    base = lm.model.base_model
    if f == "gpt2":
        mlp = base.h[L].mlp
        return mlp.act(x @ mlp.c_fc.weight + mlp.c_fc.bias)  # Conv1D: [in, out]
    if f == "bert":
        inter = base.encoder.layer[L].intermediate
        return inter.intermediate_act_fn(torch.nn.functional.linear(x, inter.dense.weight, inter.dense.bias))
    mlp = base.layers[L].mlp
    return mlp.act_fn(torch.nn.functional.linear(x, mlp.gate_proj.weight)) * torch.nn.functional.linear(x, mlp.up_proj.weight)


def _mlp_input_module(lm, L):
    base = lm.model.base_model
    return {"gpt2": lambda: base.h[L].mlp, "bert": lambda: base.encoder.layer[L].intermediate}.get(
        lm.info.family, lambda: base.layers[L].mlp)()


def test_mlp_hook_post_equals_the_mlp_computed_by_hand(tiny, texts):
    enc = hooks.encode(tiny, texts)
    got, mlp_in = {}, {}
    raw = [_mlp_input_module(tiny, L).register_forward_pre_hook(lambda m, a, L=L: mlp_in.__setitem__(L, a[0].detach()))
           for L in range(tiny.info.n_layers)]
    try:
        with hooks.points(tiny, {f"blocks.{L}.mlp.hook_post": (lambda x, L=L: got.__setitem__(L, x.detach()))
                                 for L in range(tiny.info.n_layers)}), torch.no_grad():
            tiny.model(**enc)
    finally:
        for h in raw:
            h.remove()
    for L in range(tiny.info.n_layers):
        assert got[L].shape[-1] == tiny.info.d_mlp
        torch.testing.assert_close(got[L], _mlp_by_hand(tiny, L, mlp_in[L]), atol=1e-5, rtol=1e-4)


def test_unit_points_are_the_projections_outputs(tiny, texts):
    """hook_up / hook_gate are the projections' outputs; hook_out = hook_post @ W_out (+ bias)."""
    enc = hooks.encode(tiny, texts)
    L = tiny.info.n_layers - 1
    names = [n for n in hooks.point_names(tiny, L) if ".mlp." in n]
    assert (f"blocks.{L}.mlp.hook_gate" in names) == tiny.info.gated_mlp
    seen = {}
    with hooks.points(tiny, [(n, lambda x, n=n: seen.__setitem__(n, x.detach())) for n in names]), torch.no_grad():
        tiny.model(**enc)
    W = hooks.value_vectors(tiny, L)
    out = tiny.mlp_out_module(L)
    bias = out.bias if getattr(out, "bias", None) is not None else 0
    torch.testing.assert_close(seen[f"blocks.{L}.mlp.hook_out"], seen[f"blocks.{L}.mlp.hook_post"] @ W + bias,
                               atol=1e-5, rtol=1e-4)
    assert seen[f"blocks.{L}.mlp.hook_up"].shape[-1] == tiny.info.d_mlp
    if tiny.info.family != "gpt2" and tiny.info.family != "bert":  # act(gate) * up
        mlp = tiny.model.base_model.layers[L].mlp
        torch.testing.assert_close(mlp.act_fn(seen[f"blocks.{L}.mlp.hook_gate"]) * seen[f"blocks.{L}.mlp.hook_up"],
                                   seen[f"blocks.{L}.mlp.hook_post"])


def test_residual_points_are_hugging_faces_hidden_states(tiny, texts):
    enc = hooks.encode(tiny, texts)
    n = tiny.info.n_layers
    seen = {}
    fns = [(f"blocks.{L}.hook_resid_{w}", lambda x, k=(L, w): seen.__setitem__(k, x.detach()))
           for L in range(n) for w in ("pre", "post")]
    with hooks.points(tiny, fns), torch.no_grad():
        hs = tiny.model.base_model(**enc, output_hidden_states=True).hidden_states
    torch.testing.assert_close(seen[0, "pre"], hs[0])
    for L in range(n - 1):
        torch.testing.assert_close(seen[L, "post"], hs[L + 1])
        torch.testing.assert_close(seen[L + 1, "pre"], seen[L, "post"])
    if tiny.info.family == "bert":  # no final norm: the last hidden state is the last block's output
        torch.testing.assert_close(seen[n - 1, "post"], hs[n])


def test_pattern_point_equals_eager_attentions(tiny, texts):
    enc = hooks.encode(tiny, texts)
    tiny.model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = tiny.model.base_model(**enc, output_attentions=True).attentions
    seen = {}
    with hooks.points(tiny, {f"blocks.{L}.attn.hook_pattern": (lambda p, v, L=L: seen.__setitem__(L, p.detach()))
                             for L in range(tiny.info.n_layers)}), torch.no_grad():
        tiny.model(**enc)
    assert tiny.model.config._attn_implementation == "eager"
    real = enc["attention_mask"].bool()[:, None, :, None].expand_as(ref[0])  # real queries
    for L in range(tiny.info.n_layers):
        torch.testing.assert_close(seen[L][real], ref[L][real], atol=1e-6, rtol=1e-5)


def test_returned_tensors_replace_and_several_functions_chain(tiny, texts):
    enc = hooks.encode(tiny, texts)
    d = tiny.info.d_mlp
    with torch.no_grad():
        with hooks.intervene(tiny, [(1, i, "zero", 0.0) for i in range(d)]):
            zeroed = tiny.model(**enc)[0]
        with hooks.points(tiny, {"blocks.1.mlp.hook_post": torch.zeros_like}):
            got = tiny.model(**enc)[0]
        torch.testing.assert_close(got, zeroed)
        # two functions at one point: the second sees what the first returned
        with hooks.points(tiny, [("blocks.1.mlp.hook_post", lambda x: x + 1.0), ("blocks.1.mlp.hook_post", lambda x: x - 1.0)]):
            same = tiny.model(**enc)[0]
        torch.testing.assert_close(same, tiny.model(**enc)[0], atol=1e-5, rtol=1e-4)


def test_every_handle_is_removed_after_the_block_and_after_an_error(tiny, texts):
    enc = hooks.encode(tiny, texts)
    before, impl = _n_hooks(tiny), tiny.model.config._attn_implementation
    names = hooks.point_names(tiny)
    fns = [(n, (lambda *a: None)) for n in names]
    with hooks.points(tiny, fns), torch.no_grad():
        # one handle per point, but one per attention module for its two attention points
        assert _n_hooks(tiny) == before + len(names) - tiny.info.n_layers
        assert tiny.model.config._attn_implementation == hooks.ATTN_NAME
        tiny.model(**enc)
    assert _n_hooks(tiny) == before and tiny.model.config._attn_implementation == impl
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.points(tiny, fns):
            raise RuntimeError("boom")
    assert _n_hooks(tiny) == before and tiny.model.config._attn_implementation == impl

    def fails(x):
        raise RuntimeError("boom inside the forward")
    with pytest.raises(RuntimeError, match="inside the forward"):
        with hooks.points(tiny, {"blocks.0.mlp.hook_post": fails}), torch.no_grad():
            tiny.model(**enc)
    assert _n_hooks(tiny) == before


def test_unknown_point_names_fail_in_one_line_naming_the_valid_ones(tiny):
    before = _n_hooks(tiny)
    for bad in ("blocks.0.mlp.hook_foo", "blocks.0.hook_resid_mid", "mlp.hook_post", "blocks.x.hook_resid_pre"):
        with pytest.raises(ValueError) as err:
            with hooks.points(tiny, {"blocks.0.hook_resid_pre": lambda x: None, bad: lambda x: None}):
                pass
        msg = str(err.value)
        assert "\n" not in msg and repr(bad) in msg and "valid points are" in msg
        assert "blocks.{L}.mlp.hook_post" in msg and "blocks.{L}.attn.hook_pattern" in msg
        assert ("blocks.{L}.mlp.hook_gate" in msg) == tiny.info.gated_mlp
    with pytest.raises(ValueError, match="layer"):
        hooks.resolve(tiny, f"blocks.{tiny.info.n_layers}.hook_resid_post")
    assert _n_hooks(tiny) == before  # nothing was attached


def test_units_and_edits_address_a_neuron_as_a_point_and_an_index():
    lm = models.tiny_random("llama")
    u = relations.Units.of(lm, ("up", "gate", "down"))
    d = lm.info.d_mlp
    flat = [0, 5, lm.info.n_layers * d + d + 7, u.size - 1]
    assert u.group(flat) == {"blocks.0.mlp.hook_up": [0, 5], "blocks.1.mlp.hook_gate": [7],
                             f"blocks.{lm.info.n_layers - 1}.mlp.hook_out": [lm.info.d_model - 1]}
    assert hooks.Edit(1, 3).point == "blocks.1.mlp.hook_post" == relations.Units.point("act", 1)
    for name in u.group(flat):
        hooks.resolve(lm, name)  # every address names a real point


def _tl_bridge_available():
    return importlib.util.find_spec("transformer_lens") is not None


@pytest.mark.skipif(not _tl_bridge_available(), reason="transformer_lens is not installed")
def test_points_equal_transformer_lens_run_with_cache_on_gpt2(tmp_path):
    """The same weights through a TransformerLens TransformerBridge (no folding or centring of weights):
    our ``blocks.{L}.mlp.hook_post`` and ``blocks.{L}.hook_resid_post`` are its values of the same names."""
    lm = models.tiny_random("gpt2", folder=tmp_path / "gpt2")
    br = models.bridge(lm)
    enc = hooks.encode(lm, ["a tiny test sentence for the bridge"])
    wanted = {f"blocks.{L}.{p}" for L in range(lm.info.n_layers) for p in ("mlp.hook_post", "hook_resid_post")}
    with torch.no_grad():
        _, cache = br.run_with_cache(enc["input_ids"], names_filter=lambda n: n in wanted)
    seen = {}
    with hooks.points(lm, {n: (lambda x, n=n: seen.__setitem__(n, x.detach())) for n in sorted(wanted)}), torch.no_grad():
        lm.model(input_ids=enc["input_ids"])
    for n in sorted(wanted):
        torch.testing.assert_close(seen[n].float(), cache[n].float(), atol=1e-4, rtol=1e-4)
    # the bridge wraps a copy: the model itself keeps its modules and its attention implementation
    assert br.original_model is not lm.model and type(lm.model.transformer.h[0].attn).__module__.startswith("transformers")
