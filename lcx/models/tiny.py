"""A tiny random Llama with a tokenizer built in code: the fixture model for fast tests.

`tiny_llama()` needs no files and no network. Its tokenizer is byte-level with no merges:
every UTF-8 byte is one token, so any string round-trips exactly and sequence length equals
byte length (handy when a test wants exactly T tokens: use T ASCII characters).

Vocabulary (259 ids)::

    0 <pad>   1 <s>   2 </s>   3 + b  for every byte value b in 0..255

The model is a real `LlamaForCausalLM` (GQA: 4 query heads share 2 KV heads, head_dim 16), so
patching, the engine and serving exercise the same code paths as on SmolLM2, only smaller.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
N_SPECIAL = len(SPECIAL_TOKENS)
VOCAB_SIZE = N_SPECIAL + 256

# Minimal ChatML-like template over our own special tokens, so chat endpoints can be tested on
# the tiny model. `<s>` opens a turn and `</s>` (the EOS) closes it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)

# The defaults of the tiny model; any key may be overridden (see `tiny_llama`).
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so that logits actually depend on position and context: with 0.02
    # a 2-layer model is nearly a unigram model and RoPE changes barely move the outputs.
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def byte_tokenizer():
    """The tiny model's tokenizer: byte-level, 259 ids, built in code (no files, no training).

    Returns a `transformers` fast tokenizer (`PreTrainedTokenizerFast`) with bos/eos/pad set
    and a chat template. It does not add BOS automatically; prepend `tokenizer.bos_token_id`
    yourself when a test wants one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps each byte to a printable unicode char (GPT-2's table); order the vocab by
    # byte value so that id == 3 + byte.
    byte_to_char = gpt2_bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_to_char[b]: N_SPECIAL + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no GPT-2 word splitting, we have no merges anyway.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=int(1e9),
    )


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char table (the one `ByteLevel` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _allowed_config_keys() -> set[str]:
    from transformers import LlamaConfig

    params = inspect.signature(LlamaConfig.__init__).parameters
    # rope_theta: transformers folds it into rope_parameters; attn_implementation: picks the
    # attention backend (eager / sdpa / flex_attention).
    return {p for p in params if p != "self"} | {"rope_theta", "attn_implementation"}


def tiny_config(**overrides: Any):
    """`LlamaConfig` of the tiny model, with `overrides` applied on top of `TINY_DEFAULTS`.

    Unknown keys raise `ValueError` naming them (LlamaConfig itself would silently keep them).
    `rope_theta=` is accepted as a shortcut for the theta inside `rope_parameters`.
    """
    from transformers import LlamaConfig

    bad = sorted(set(overrides) - _allowed_config_keys())
    if bad:
        raise ValueError(f"tiny_llama: unknown config key(s) {bad}; valid keys are LlamaConfig's "
                         "arguments plus 'rope_theta' and 'attn_implementation'")
    kw = {**TINY_DEFAULTS, **overrides}
    kw["rope_parameters"] = dict(kw["rope_parameters"])
    if "rope_theta" in kw:
        kw["rope_parameters"]["rope_theta"] = float(kw.pop("rope_theta"))
    if kw["vocab_size"] < VOCAB_SIZE:
        raise ValueError(f"tiny_llama: vocab_size={kw['vocab_size']} is smaller than the "
                         f"tokenizer's {VOCAB_SIZE} ids")
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides: Any):
    """A tiny random `LlamaForCausalLM` (float32, eval mode) and its in-code byte tokenizer.

    Defaults: hidden 64, 2 layers, 4 query heads / 2 KV heads (GQA), head_dim 16,
    intermediate 128, max_position_embeddings 128, rope_theta 1e4, vocab 259.
    `overrides` are `LlamaConfig` keys (e.g. `num_hidden_layers=3`, `rope_theta=5e5`,
    `attn_implementation="eager"`); unknown keys raise `ValueError`.

    The weights depend only on `seed` and the config: initialisation runs under a forked RNG
    so the caller's global torch RNG state is left untouched.

    Returns `(model, tokenizer)`; `model(input_ids).logits` is `[B, T, 259]` for
    `input_ids: [B, T]` (int64).
    """
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    return model, byte_tokenizer()


def save_tiny_llama(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write `tiny_llama(seed, **overrides)` as a Hugging Face directory (safetensors + tokenizer).

    The directory loads with `lcx.load_model(path)` or `AutoModelForCausalLM.from_pretrained`.
    Returns the directory path.
    """
    path = Path(path)
    model, tokenizer = tiny_llama(seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
