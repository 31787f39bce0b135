"""Studies: experiments that use the library and live beside it, never inside it.

- `lcx.studies.modadd`: the modular-addition robustness study (arXiv 2601.04283), `lcx train modadd`.
- `lcx.studies.code_edit`: the PIE code-editing protocol (arXiv 2407.03157) on stdlib code:
  samples, edits, each KV-cache update strategy, scores with confidence intervals; `lcx bench pie`.

A study may import anything from lcx; nothing in the library imports a study
(tests/test_layers.py), and the wheel leaves studies out (pyproject.toml; `lcx.cli.SOURCE_ONLY`):
they run from a source checkout.
"""
