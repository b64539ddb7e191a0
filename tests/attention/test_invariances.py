"""Scale invariances that hold exactly in exact arithmetic (docs/attention.md), checked with hypothesis."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from quest.attention import get_attention, list_attentions

B, H, N, D = 2, 3, 6, 8
# norm eps far below any vector norm here, so "exact" means float64 round-off
LN = functools.partial(nn.LayerNorm, eps=1e-14)
SCALED = ("keys", "queries")
#: the paper's formulations and what each is invariant to, written out here as the reference the declared
#: ``scale_invariant_in`` of each class must match (docs/attention.md)
PAPER_INVARIANCES = {
    "standard": set(), "quest": {"keys"}, "qnorm": {"queries"},
    "qknorm": {"keys", "queries"}, "qknorm_hs": {"keys", "queries"}, "qknorm_ds": {"keys", "queries"},
}
# every registered formulation, each (formulation, input) pair in the test its declaration puts it in: a new
# built-in formulation is tested without being listed here
INVARIANT = [(n, w) for n in list_attentions() for w in SCALED if w in get_attention(n).scale_invariant_in]
VARIANT = [(n, w) for n in list_attentions() for w in SCALED if w not in get_attention(n).scale_invariant_in]

scales = st.lists(st.floats(min_value=0.05, max_value=20.0), min_size=N, max_size=N)


def _layer(name):
    options = {"eps": 1e-14} if "eps" in get_attention(name).options else {}
    return get_attention(name, **options)(H * D, num_heads=H, norm_layer=LN).double().eval()


def _outputs(name, seed, which, c):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=gen, dtype=torch.float64) for _ in range(3))
    layer = _layer(name)
    c = torch.tensor(c, dtype=torch.float64).view(1, 1, N, 1)  # one positive constant per token
    scaled = (q * c, k) if which == "queries" else (q, k * c)
    return layer.attend(q, k, v), layer.attend(*scaled, v)


def test_the_paper_formulations_declare_their_invariances():
    assert {n: set(get_attention(n).scale_invariant_in) for n in PAPER_INVARIANCES} == PAPER_INVARIANCES


@pytest.mark.parametrize("name, which", INVARIANT)
@settings(max_examples=25, deadline=None)
@given(c=scales, seed=st.integers(0, 2**16))
def test_invariant_formulations_ignore_positive_scaling(name, which, c, seed):
    base, scaled = _outputs(name, seed, which, c)
    torch.testing.assert_close(scaled, base, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name, which", VARIANT)
@settings(max_examples=25, deadline=None)
@given(c=st.floats(min_value=2.0, max_value=20.0), seed=st.integers(0, 2**16))
def test_other_formulations_change_under_scaling(name, which, c, seed):
    base, scaled = _outputs(name, seed, which, [c] * N)
    assert (scaled - base).abs().max() > 1e-3
