"""Byte-level BPE tokenizer for the bundled models, trained with the `tokenizers` library.

Byte-level means every string round-trips exactly (`decode(encode(s)) == s`): text is first
mapped to bytes, so there is no unknown token and no normalisation. Special tokens:
`<s>` (bos, id 0), `</s>` (eos, id 1), `<pad>` (id 2). The saved form is a
`PreTrainedTokenizerFast` directory (`tokenizer.json`, `tokenizer_config.json`), loadable
with `AutoTokenizer.from_pretrained(dir)`.

Determinism: BPE training counts pairs and breaks ties by the pair itself, so the same texts
in the same order give the same merges (tested); we train on the train split only.
"""

from __future__ import annotations

from typing import Iterable, Sequence

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2, *,
                    split_digits: bool = False):
    """Train a byte-level BPE on `texts` and wrap it as a `PreTrainedTokenizerFast`.

    `vocab_size` counts the 256 byte symbols and the 3 special tokens. `split_digits=True` makes
    every digit its own token (no merges across digits, as in Llama/SmolLM tokenizers): numbers
    then tokenize predictably, which copying a number (passkey retrieval, arithmetic) needs. A
    space before a number stays its own token (" 48213" -> " ", "4", "8", "2", "1", "3").
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # GPT-2 style: split on words/numbers/punctuation, a leading space belongs to the word.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok):
    """`tokenizers.Tokenizer` -> `PreTrainedTokenizerFast` with bos/eos/pad set and no cleanup."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,  # would alter text (" ." -> ".") and break round-trips
        model_max_length=1_000_000_000,  # no truncation warnings; the model decides its length
    )


def encode_documents(tokenizer, texts: Sequence[str], *, eos_between: bool = True) -> list[int]:
    """Token ids of `texts` concatenated into one stream, `</s>` after each text.

    No bos is added: the models are trained on windows cut from this stream at arbitrary
    offsets, so a window rarely starts at a document start and bos would be out of
    distribution. Texts are encoded one by one (document boundaries never merge tokens).
    """
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos_between:
            ids.append(eos)
    return ids


__all__ = ["BOS", "EOS", "PAD", "SPECIAL_TOKENS", "encode_documents", "train_tokenizer", "wrap_tokenizer"]
