"""Training corpora of `lcx train lm` (`--corpus`, `TrainConfig.corpus`): one registry, `CORPORA`.

`text` (Shakespeare + KJV, the default), `stdlib-code`, the Python standard library's train
packages (`lcx.data.code`: split by package, held-out loss on its val packages; the code-edit
benchmark's eval packages are never read, and the split is recorded in the log and the model's
train_config.json as `code_split`), or `python-code`: those packages plus third-party code from
site-packages (`lcx.data.code.site_code`: filtered, at most 200 kB per package, and
decontaminated against the stdlib's val and eval packages; the rule and counts are logged as
`site_code`, the file list is written to OUT/site_code_files.json, and `--resume` refuses a
changed selection).
"""

from __future__ import annotations

from typing import Callable


def _text_corpus(split: str):
    from lcx.data import load_corpus

    return load_corpus("train" if split == "train" else "validation")


def _stdlib_code_corpus(split: str):
    from lcx.data.code import load_code_corpus

    return load_code_corpus("train" if split == "train" else "val")


def _python_code_corpus(split: str):
    from lcx.data.code import default_site_code, load_code_corpus

    if split != "train":
        return load_code_corpus("val")  # the same held-out packages as stdlib-code: comparable losses
    return load_code_corpus("train") + default_site_code().documents


# Training corpora: name -> loader(split) -> list[lcx.data.Document], split "train" or "held_out".
# `stdlib-code` is Python standard-library code split by package (lcx.data.code): its train and
# val packages are disjoint from the "eval" packages the code-edit benchmark samples from.
CORPORA: dict[str, Callable[[str], list]] = {
    "text": _text_corpus,  # Shakespeare + KJV, held-out works (lcx.data.corpus)
    "stdlib-code": _stdlib_code_corpus,
    # stdlib-code's train packages + third-party code from site-packages, decontaminated against
    # the stdlib's val and eval packages (lcx.data.code.site_code); held out: the val packages
    "python-code": _python_code_corpus,
}
CODE_CORPORA = ("stdlib-code", "python-code")  # corpora whose runs record the stdlib split
