"""Studies: experiments that use the library and live beside it, never inside it.

- `studies.modadd`: the modular-addition robustness study (arXiv 2601.04283), `lcx train modadd`.
- `studies.code_edit`: the PIE code-editing protocol (arXiv 2407.03157) on stdlib code:
  samples, edits, each KV-cache update strategy, scores with confidence intervals; `lcx bench pie`.
- `studies.lm_infinite_window_probe`: why LM-Infinite loses a needle inside its window at 16k on
  SmolLM2 (#32; `python studies/lm_infinite_window_probe.py`).

A study may import anything from lcx; nothing in the library imports a study
(tests/test_layers.py), and the wheel leaves studies out (pyproject.toml; `lcx.cli.EXPERIMENTS`):
they run from a source checkout.
"""
