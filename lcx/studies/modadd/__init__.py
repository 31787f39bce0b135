"""The modular-addition robustness study (arXiv 2601.04283; `lcx train modadd`).

- `.model`: the encoder (`ModAddEncoder`, position encodings NoPE / learned / RoPE / ALiBi).
- `.study`: recipes, training, the study grid, aggregation, the decoder-only variant, the CLI.
The data (`lcx.data.modadd`) stays in the library: the lm-eval task `modadd_shift` uses it.
"""
