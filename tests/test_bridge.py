"""Our hook point is TransformerLens' ``blocks.{L}.mlp.hook_post``, through a TransformerBridge."""
import pytest
import torch

from lib import hooks, models


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "gemma2"])
def test_mlp_activations_equal_transformer_lens_hook_post(family, tmp_path):
    lm = models.tiny_random(family, folder=tmp_path / family)
    br = models.bridge(lm)
    enc = hooks.encode(lm, ["a tiny test sentence"])
    _, cache = br.run_with_cache(enc["input_ids"], names_filter=lambda n: n.endswith("mlp.hook_post"))
    stats = hooks.mlp_activation_stats(lm, ["a tiny test sentence"], progress=False)
    for L in range(lm.info.n_layers):
        torch.testing.assert_close(cache[f"blocks.{L}.mlp.hook_post"][0].mean(0).float(), stats.mean[L],
                                   atol=1e-5, rtol=1e-4)
