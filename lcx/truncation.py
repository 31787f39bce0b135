"""Never a silent wrong length: a prompt lm-eval would cut is an error, not a shorter measurement.

lm-eval's models keep requests within their `max_length` by LEFT-TRUNCATING them with a log line
and going on: HFLM (and so the `lcx` model) and `local-completions` cut a generation prompt to
`max_length - max_gen_toks` tokens, a log-likelihood request to its last `max_length` (+1 for
HFLM) tokens, and split a rolling log-likelihood document into windows of `max_length`. The run
exits 0 and every metric is still named by the length the task asked for: a "4096" passkey run
against a 1,024-token server scored ~1,011-token prompts. For a testbed whose answers are scores
by context length that is a wrong number, so lcx's lm-eval models refuse instead
(`PromptTooLongError`, naming the task, the prompt's tokens, the limit and the flag that raises
it), unless `allow_truncation=true` is in `--model_args` (lm-eval's behaviour, for users who want
it: the error says so).

This module states the rule once; `lcx.lmeval_model.LcxLM` and the patched `local-completions`
(`lcx._lmeval_hook`) call `check_*` with their own class's cut condition. It imports nothing
heavy (the lm-eval hook loads it).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

ALLOW_KEY = "allow_truncation"  # the --model_args key that restores lm-eval's left truncation


class PromptTooLongError(ValueError):
    """A request longer than the model's `max_length`: lm-eval would cut it and score a shorter
    prompt than its task asked for."""


def allow_truncation(value: Any) -> bool:
    """`allow_truncation=` as given in `--model_args` (a bool, or lm-eval's string) -> bool."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no", ""):
        return False
    raise ValueError(f"{ALLOW_KEY} must be true or false, got {value!r}")


def _tasks(instances: Iterable[Any] | None) -> str:
    names = sorted({str(t) for t in (getattr(r, "task_name", None) for r in instances or ()) if t})
    return ", ".join(names) if names else "(task not named)"


def refusal(*, tasks: str, kind: str, tokens: int, needed: int, limit: int, limit_source: str,
            raise_with: str) -> PromptTooLongError:
    """The error: what the task asked for, what the model takes, and how to make them agree."""
    return PromptTooLongError(
        f"{tasks}: a {kind} request of {tokens:,} tokens needs {needed:,} tokens of context, more than "
        f"max_length {limit:,} ({limit_source}). lm-eval would LEFT-TRUNCATE it and score a shorter prompt "
        f"than the task's length; lcx refuses. Raise the limit ({raise_with}), or run the task at lengths "
        f"that fit (e.g. --metadata '{{\"max_seq_lengths\": [...]}}'); `{ALLOW_KEY}=true` in --model_args "
        f"accepts cut prompts.")


def check_generation(instances: Sequence[Any], encoded: Sequence[Sequence[int]], max_gen_toks: Sequence[int],
                     limit: int, **where: str) -> None:
    """Generation requests: lm-eval keeps the last `limit - max_gen_toks` prompt tokens (HFLM and
    TemplateAPI alike), so a prompt with its generation budget must fit in `limit`.
    `where`: `limit_source`, `raise_with` (see `refusal`)."""
    over = [(len(e) + g, len(e), r) for e, g, r in zip(encoded, max_gen_toks, instances, strict=True)
            if len(e) + g > limit]
    if over:
        needed, tokens, _ = max(over, key=lambda x: x[0])
        raise refusal(tasks=_tasks(r for *_, r in over), kind=f"generation (prompt + {needed - tokens:,} to generate)",
                      tokens=tokens, needed=needed, limit=limit, **where)


def check_loglikelihood(requests: Iterable[tuple[Any, Sequence[int], Sequence[int]]], limit: int, *,
                        tasks: str = "(task not named)", input_drops_last: bool = False, **where: str) -> None:
    """`(key, context_enc, continuation_enc)` requests: cut when the tokens the model is given
    exceed `limit`. HFLM gives context + continuation but its last token (`input_drops_last`),
    TemplateAPI sends them all against its `max_length` (lm-eval's `max_length - 1`)."""
    drop = 1 if input_drops_last else 0
    longest = max((len(c) + len(t) - drop for _, c, t in requests), default=0)
    if longest > limit:
        raise refusal(tasks=tasks, kind="log-likelihood", tokens=longest, needed=longest, limit=limit, **where)


def check_rolling(lengths: Iterable[int], limit: int, *, tasks: str = "(task not named)", **where: str) -> None:
    """Rolling log-likelihood documents (perplexity): a document of more than `limit` tokens is
    split into windows, so its later tokens are scored with less context than the task's length."""
    longest = max(lengths, default=0)
    if longest > limit:
        raise refusal(tasks=tasks, kind="rolling log-likelihood (perplexity)", tokens=longest, needed=longest,
                      limit=limit, **where)


def task_names(instances: Iterable[Any]) -> str:
    """The tasks of lm-eval `Instance`s, for the error."""
    return _tasks(instances)
