"""Studies: experiments that use the library and live beside it, never inside it.

- `lcx.studies.modadd`: the modular-addition robustness study (arXiv 2601.04283), `lcx train modadd`.

A study may import anything from lcx; nothing in the library imports a study.
"""
