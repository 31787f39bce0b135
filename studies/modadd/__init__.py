"""The modular-addition robustness study (arXiv 2601.04283; `lcx train modadd`).

Task: `(a + b) mod 97` read as characters, on the ordered-pair split of `lcx.data.modadd` (the
data stays in the library: the lm-eval task `modadd_shift` uses it). One module per concern:

    model.py       the encoder (`ModAddEncoder`, position encodings NoPE / learned / RoPE / ALiBi)
    recipes.py     `Recipe`, `RECIPES`: the paper's four interventions as flags, and their schedule
    config.py      `RunConfig` (one run), `StudyConfig` (configurations x seeds), run files
    data.py        texts per recipe, `[CLS]` packing, a batch as a function of (seed, step)
    training.py    the loss (CE + consistency KL + masked characters), AdamW, `train_run`
    evaluation.py  accuracy per split (id, position shift, template OOD), place-value errors
    aggregate.py   table.json / table.md from the run files
    plots.py       shift.png, ablation.png, learning.png
    study.py       the committed studies (`STUDY_PRESETS`) and `run_study`
    decoder.py     the decoder-only variant, exported for lm-eval
    cli.py         `lcx train modadd`
"""
