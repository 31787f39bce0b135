"""`AttentionSpec.swat`: explicit slopes are used as given (any head count); the balanced default
needs an even head count and says so."""

import pytest

from lcx.attention import AttentionSpec
from lcx.attention.alibi import alibi_slopes


def test_swat_spec_takes_explicit_slopes_for_odd_heads():
    slopes = tuple(alibi_slopes(9))
    spec = AttentionSpec.swat(8, n_heads=9, alibi_slopes=slopes)
    assert spec.activation == "sigmoid" and tuple(spec.alibi_slopes) == slopes


def test_swat_spec_default_slopes_need_even_heads():
    assert len(AttentionSpec.swat(8, n_heads=4).alibi_slopes) == 4
    with pytest.raises(ValueError):
        AttentionSpec.swat(8, n_heads=9)
