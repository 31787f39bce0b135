"""Fixtures shared by tests/methods: private tiny Llamas (`lcx.models.tiny`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model64():
    """A private float64 tiny Llama (4 heads / 2 kv heads, head_dim 16) with a byte tokenizer."""
    from lcx.models.tiny import tiny_llama

    m, tok = tiny_llama(seed=1)
    return m.double().eval(), tok


@pytest.fixture(scope="module")
def model32():
    from lcx.models.tiny import tiny_llama

    m, tok = tiny_llama(seed=2)
    return m.eval(), tok
