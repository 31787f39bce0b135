"""Docs for `lcx_ppl`: windows of held-out works of the lcx corpus, cut in the model's tokens.

Text: `lcx.data.corpus.load_corpus("validation")`, works held out of training whole (four
Shakespeare plays, four Bible books), one document per work (the modern edition where a play
has two, so near-duplicate text is not scored twice).

Windows. Each work is tokenized once with the model's tokenizer and cut into consecutive,
non-overlapping windows of `max(max_seq_lengths)` tokens (a final partial window is dropped).
A doc is one window; its text for length L is the window's first L tokens, decoded by character
offsets and re-checked to tokenize to at most L tokens. lm-eval's `loglikelihood_rolling` then
scores those L tokens in one forward pass of L positions (the backend's BOS/EOS prefix plus the
first L-1 tokens), so bucket L measures the model at context L; buckets of one doc are nested
prefixes of the same text. Docs are interleaved across works, so `--limit k` samples several
works. Metadata: `max_seq_lengths` (default 256, 512, 1024), `max_docs` (default: all windows),
`window_tokens` (default: max(max_seq_lengths); a larger value cuts the same windows as a run
over longer lengths would, so one length evaluated alone scores the same text as it does in a
sweep: `lcx report` evaluates length by length this way).

Not the protocol of `lcx eval ppl` (`lcx.eval.perplexity`), which joins the split's documents
into one token stream, tiles the same evenly spaced chunks by every length, scores n - 1 tokens
per window without a prefix token and reports nats per token. Here: per-work windows, bucket L a
prefix of its window, all L tokens scored after lm-eval's prefix token, per-word / per-byte
metrics (comparable across tokenizers). The two share no window or scoring code on purpose: each
has committed numbers; `lcx.eval.perplexity`'s docstring lists the differences and when to use which.
"""

from __future__ import annotations

from typing import Any

from lcx.eval_tasks.common import get_int, lengths_from, n_tokens, round_robin, tokenizer_from

DEFAULT_LENGTHS = (256, 512, 1024)


def works(split: str = "validation") -> list[tuple[str, str]]:
    """`(work, text)` for each work of the split, one edition per work, sorted by work."""
    from lcx.data.corpus import load_corpus

    chosen: dict[str, Any] = {}
    for d in load_corpus(split):
        prev = chosen.get(d.work)
        # prefer the modern edition (`*_gut`) over the First Folio (`*_gut_f`)
        if prev is None or (prev.name.endswith("_f") and not d.name.endswith("_f")):
            chosen[d.work] = d
    return [(w, chosen[w].text) for w in sorted(chosen)]


def windows(tokenizer: Any, text: str, lengths: list[int], tail: bool = False,
            window_tokens: int | None = None) -> list[dict]:
    """Non-overlapping windows of max(lengths, window_tokens) tokens; per window the text of each
    prefix length.

    With `tail=True` each prefix of L tokens is also split at token L // 2: `contexts[i]` is its
    first half and `continuations[i]` the rest (together at most L tokens when re-tokenized).
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    size = max(max(lengths), window_tokens or 0)
    out = []
    for start in range(0, len(offs) - size + 1, size):
        texts, counts, contexts, continuations = [], [], [], []
        for L in lengths:
            end = start + L  # exclusive token index
            cut = offs[start + L // 2][0]  # character where the second half starts
            while True:
                chunk = text[offs[start][0]:offs[end - 1][1]]
                c = n_tokens(tokenizer, chunk)
                if tail:
                    ctx, cont = text[offs[start][0]:cut], text[cut:offs[end - 1][1]]
                    c = max(c, n_tokens(tokenizer, ctx) + n_tokens(tokenizer, cont))
                if c <= L or end - 1 <= start + L // 2:
                    break
                end -= 1  # re-tokenized text came out longer: drop a token and retry
            texts.append(chunk)
            counts.append(c)
            if tail:
                contexts.append(ctx)
                continuations.append(cont)
        w = {"start_token": start, "texts": texts, "n_tokens": counts}
        if tail:
            w.update(contexts=contexts, continuations=continuations)
        out.append(w)
    return out


def make_docs(tokenizer: Any, lengths: list[int], max_docs: int | None = None, tail: bool = False,
              window_tokens: int | None = None) -> list[dict]:
    per_work = []
    for work, text in works("validation"):
        docs = []
        for w in windows(tokenizer, text, lengths, tail, window_tokens):
            doc = {"work": work, "answer": work, "lengths": list(lengths), "prompts": w["texts"],
                   "n_tokens": w["n_tokens"], "start_token": w["start_token"]}
            if tail:  # scored: continuation given context (loglikelihood)
                doc.update(prompts=w["contexts"], continuations=w["continuations"])
            docs.append(doc)
        per_work.append(docs)
    docs = round_robin(per_work)
    if not docs:
        raise ValueError(f"lcx_ppl: no held-out work has {max(max(lengths), window_tokens or 0)} tokens; "
                         "use smaller max_seq_lengths / window_tokens")
    return docs[:max_docs] if max_docs else docs


def dataset(tail: bool = False, **meta: Any):
    """lm-eval `custom_dataset`: `{"test": Dataset}` (YAML `dataset_kwargs: {tail: true}` for lcx_ppl_tail)."""
    import datasets

    docs = make_docs(tokenizer_from(meta), lengths_from(meta, DEFAULT_LENGTHS),
                     get_int(meta, "max_docs", 0) or None, tail=bool(tail),
                     window_tokens=get_int(meta, "window_tokens", 0) or None)
    return {"test": datasets.Dataset.from_list(docs, split=datasets.Split.TEST)}
