"""`lcx.presets`' `dca`: ChunkLlama's defaults as a function of the model's L0 (issue #77 item 1).

`replace_with_chunkllama(pretraining_length=L0)`: chunk_size 3 L0 // 4, local window L0 // 16 (its
first release), the same at every target length (DCA bounds every distance by chunk_size), the
model's RoPE as loaded. Odd L0 to pin the rounding.
"""

from __future__ import annotations

import pytest

from lcx import presets
from lcx.methods.dca import DCA, chunkllama_dca, dca


@pytest.mark.parametrize("L0, chunk, local", [(8192, 6144, 512), (2048, 1536, 128), (131072, 98304, 8192),
                                              (129, 96, 8), (16, 12, 1)])
def test_preset_is_chunkllama_defaults(L0, chunk, local):
    for factor in (1, 2, 3.5, 4):  # the factor does not enter
        cfg = presets.config("dca", L0=L0, factor=factor)
        assert cfg.attention == dca(chunk, local) == chunkllama_dca(L0)
        assert cfg.rope is None and cfg.to_dict() == {"attention": {"type": "dca", "chunk_size": chunk,
                                                                     "local_size": local}}
        assert isinstance(cfg.attention, DCA) and cfg.attention.chunk_len == chunk - local


def test_preset_refuses_a_context_without_a_local_window():
    with pytest.raises(ValueError, match=r"dca: ChunkLlama's local_size L0 // 16 needs L0 >= 16, got L0=15"):
        presets.config("dca", L0=15, factor=2)


def test_dca_and_string_are_run_on_request_only():
    """Neither joins `lcx report`'s default methods (each decode step of DCA runs its three passes
    through `attend`, STRING's shifted pass scans every key: the default report stays fast);
    `--presets dca,string` runs them."""
    from lcx.report.config import DEFAULT_METHODS

    assert not presets.get("dca").in_report and not presets.get("string").in_report
    assert "dca" not in DEFAULT_METHODS and "string" not in DEFAULT_METHODS
    names = list(presets.PRESETS)
    assert names.index("self_extend") < names.index("dca") < names.index("string")
