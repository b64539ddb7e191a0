"""The collector computes alike attention layers in one batched pass: the same statistics as each layer's own, in a
number of operations that does not grow with the depth."""
from __future__ import annotations

import pytest
import torch

from quest.diagnostics import AttentionDiagnostics
from quest.diagnostics.stats import HEAD_STATS, SCALAR_STATS
from quest.models import create_model


def _stat_inputs(depth: int, attention: str = "quest") -> tuple[AttentionDiagnostics, list]:
    """Every layer's (q_raw, k_raw, q_eff, k_eff, scale, mask, causal), as the collector's hooks take them."""
    torch.manual_seed(0)
    model = create_model("vit_pico_patch4_16", attention, depth=depth, num_classes=3).eval()
    diag = AttentionDiagnostics(model, every_n_steps=1, num_samples=2)
    inputs = []
    x = model.patch_embed(torch.randn(2, 3, 16, 16))
    x = model._pos_embed(x)
    with torch.no_grad():
        for block in model.blocks:
            h = block.norm1(x)
            layer = block.attn
            inputs.append((*layer.project_qkv(h)[:2], *layer.effective_qk(h), None, False))
            x = block(x)
    return diag, inputs


@pytest.mark.parametrize("attention", ["standard", "quest", "qknorm_hs"])
def test_the_stacked_statistics_equal_each_layer_s_own(attention):
    """The collector computes alike layers in one batched pass: the same numbers as each layer's own."""
    from quest.diagnostics.stats import layer_statistics

    diag, inputs = _stat_inputs(4, attention)
    stacked = diag._statistics(inputs)
    for got, layer_inputs in zip(stacked, inputs):
        want = layer_statistics(*layer_inputs[:5], diag.entropy_threshold, *layer_inputs[5:])
        for stat in SCALAR_STATS:
            torch.testing.assert_close(got.scalars[stat], want.scalars[stat], rtol=1e-6, atol=1e-7, msg=stat)
        for stat in HEAD_STATS:
            torch.testing.assert_close(got.heads[stat], want.heads[stat], rtol=1e-6, atol=1e-7, msg=stat)


def test_the_statistics_launch_as_many_kernels_whatever_the_depth():
    """A diagnostics step's statistics are a fixed number of batched operations (counted at the dispatcher, the
    GPU proxy of bench/dispatch_proxy.py): 2 layers and 6 layers dispatch the same count, per layer they would not."""
    from bench.dispatch_proxy import DispatchCost

    counts = []
    for depth in (2, 6):
        diag, inputs = _stat_inputs(depth)
        with DispatchCost() as cost:
            diag._statistics(inputs)
        counts.append(cost.launches)
    assert counts[0] == counts[1], counts
