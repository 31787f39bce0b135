"""Code-editing evaluation of KV-cache update strategies on Python standard-library files.

Protocol (after PIE, arXiv 2407.03157, whose RepoBench-C setting we cannot download here):

1. Sample. A window of real code (a stdlib `.py` file, not written by us) ending at a line
   break, about `ctx_tokens` tokens; the target is the next line of the file with >= 8
   non-blank characters, not a comment. Target policy (`TARGET_POLICIES`, chosen before any
   model runs, the same for every strategy): `any` takes such a line; `context` takes one only
   if every identifier it uses (Python keywords, builtins, `self` and `cls` aside; at least one)
   occurs in the edited prompt, i.e. a line that needs the context to be written (the spirit of
   RepoBench-C, whose targets use code defined elsewhere in the prompt). A `context` target
   measures what PIE must preserve, the use of the cached context after an edit.
2. Edit. A random line-level edit inside the window, away from its last two lines:
   `insertion` (1-4 lines copied from elsewhere in the same file), `deletion` (1-4 lines) or
   `multi` (2-3 insertions / deletions / line replacements at different places). The edited
   window is re-tokenized and the token-level difference (difflib opcodes on token ids) gives
   the `Edit`s in original coordinates, so edits come from text edits.
3. Cache. The prompt is the window without its final line break (BPE merges a newline with
   the next line's indentation, so a prompt ending in a bare newline token is out of
   distribution). The prompt minus its last token is prefilled once; each strategy updates a
   copy of that cache with the edits (its cost is recorded); then the last token is fed and
   the model decodes greedily: the completion is the first non-blank line after the line
   break it generates (at most `max_new_tokens` tokens).
4. Scores. Exact match (whitespace-stripped) and edit similarity (`difflib` ratio) of every
   strategy's completion against `recompute`'s completion (recompute is exact) and against the
   true next line; compute as tokens encoded, approximate FLOPs and wall time of the update.
"""

from __future__ import annotations

import builtins
import difflib
import keyword
import random
import re
import statistics
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from lcx.cache.kv import PositionedKVCache
from lcx.cache.pie import EDIT_STRATEGIES, Edit, apply_edits, update_cache
from lcx.hf.generate import greedy_decode_ref
from lcx.stats import Z95, paired_difference, wilson_interval  # noqa: F401 (re-exported)

EDIT_KINDS = ("insertion", "deletion", "multi")
TARGET_POLICIES = ("any", "context")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UBIQUITOUS = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}


def uses_only_context(line: str, prompt: str) -> bool:
    """True if `line` names at least one identifier beyond keywords, builtins, `self`, `cls`,
    and every such identifier occurs as a whole word in `prompt` (the `context` target policy)."""
    names = {n for n in _IDENTIFIER.findall(line) if n not in _UBIQUITOUS}
    seen = set(_IDENTIFIER.findall(prompt))
    return bool(names) and names <= seen


def stdlib_files(min_lines: int = 200, split: str | None = None) -> list[Path]:
    """Python files of the running interpreter's standard library (tests and site-packages
    excluded, `lcx.data.code.stdlib_py_files`), at least `min_lines` long, sorted by path.
    `split` ("train" | "val" | "eval") keeps only that split of `lcx.data.code.code_split`
    (by package, so a model fine-tuned on the train split never saw an eval file)."""
    from lcx.data.code import code_split, stdlib_py_files

    files = stdlib_py_files() if split is None else code_split()[split]
    out = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.count("\n") >= min_lines:
            out.append(p)
    return out


@dataclass
class CodeEditSample:
    """One evaluation case: token ids before/after the edit, the edits, the true next line."""

    source: str  # file path relative to the stdlib root, and line range
    kind: str
    old_ids: list[int]
    new_ids: list[int]
    edits: list[Edit]
    target: str
    n_edited_lines: int

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "n_old": len(self.old_ids),
                "n_new": len(self.new_ids), "n_edits": len(self.edits),
                "edited_tokens": sum(len(e.new_token_ids) for e in self.edits),
                "removed_tokens": sum(e.end - e.start for e in self.edits),
                "first_edit": self.edits[0].start if self.edits else None,
                "n_edited_lines": self.n_edited_lines, "target": self.target}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_edits(old: Sequence[int], new: Sequence[int]) -> list[Edit]:
    """The `Edit`s (original coordinates) turning `old` into `new`: difflib's non-equal opcodes."""
    sm = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
    return [Edit(i1, i2, tuple(new[j1:j2])) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]


def _line_edit_ops(rng: random.Random, kind: str, n_lines: int, donor: list[str]) -> list[tuple[int, int, list[str]]]:
    """Line-level edits `(start, end, new_lines)` on a window of n_lines (last two left alone)."""
    editable = n_lines - 2
    if editable < 4:
        raise ValueError("window too short to edit")

    def one(op: str, lo: int, hi: int) -> tuple[int, int, list[str]]:
        k = rng.randint(1, min(4, hi - lo))
        s = rng.randint(lo, hi - k)
        d0 = rng.randrange(0, max(1, len(donor) - k))
        if op == "insertion":
            return (s, s, donor[d0:d0 + k])
        if op == "deletion":
            return (s, s + k, [])
        return (s, s + 1, donor[d0:d0 + 1])  # replacement of one line

    if kind in ("insertion", "deletion"):
        return [one(kind, 0, editable)]
    n = rng.randint(2, 3)
    bounds = sorted(rng.sample(range(1, editable), n - 1))
    parts = list(zip([0, *bounds], [*bounds, editable]))
    ops = []
    for lo, hi in parts:
        if hi - lo >= 2:
            ops.append(one(rng.choice(("insertion", "deletion", "replacement")), lo, hi - 1))
    if len(ops) < 2:
        raise ValueError("could not place two edits")
    return ops


def make_samples(tokenizer: Any, n: int, ctx_tokens: int, *, kinds: Sequence[str] = EDIT_KINDS,
                 seed: int = 0, files: Sequence[Path] | None = None, targets: str = "any",
                 max_tries: int = 50) -> list[CodeEditSample]:
    """`n` samples cycling through `kinds`, from stdlib files chosen with `seed`, with target
    lines chosen by the `targets` policy (`TARGET_POLICIES`)."""
    if targets not in TARGET_POLICIES:
        raise ValueError(f"targets must be one of {TARGET_POLICIES}, got {targets!r}")
    rng = random.Random(seed)
    files = list(files) if files is not None else stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    samples: list[CodeEditSample] = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        for _ in range(max_tries):
            s = _try_sample(tokenizer, rng.choice(files), kind, ctx_tokens, rng, root, targets)
            if s is not None:
                samples.append(s)
                break
        else:
            raise RuntimeError(f"no valid {kind} sample after {max_tries} tries (ctx_tokens={ctx_tokens})")
    return samples


def _try_sample(tokenizer, path: Path, kind: str, ctx_tokens: int, rng: random.Random,
                root: Path, targets: str = "any") -> CodeEditSample | None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    # target: a non-blank, non-comment line with some content, far enough into the file
    cands = [i for i in range(40, len(lines)) if len(lines[i].strip()) >= 8
             and not lines[i].lstrip().startswith("#")]
    if not cands:
        return None
    t = rng.choice(cands)
    # grow the window backwards line by line up to ~ctx_tokens tokens
    start, n_tok = t, 0
    while start > 0 and n_tok < ctx_tokens:
        start -= 1
        n_tok += len(_encode(tokenizer, lines[start]))
    if n_tok < ctx_tokens * 0.8:
        return None
    window = lines[start:t]
    donor = lines[:start] + lines[t + 1:]
    if len(donor) < 8:
        return None
    try:
        ops = _line_edit_ops(rng, kind, len(window), donor)
    except ValueError:
        return None
    new_window = list(window)
    for s, e, repl in reversed(ops):  # right to left keeps earlier line indices valid
        new_window[s:e] = repl
    if targets == "context" and not uses_only_context(lines[t], "".join(new_window)):
        return None
    # the prompt stops before the window's final line break (see `greedy_line`)
    old_ids = _encode(tokenizer, "".join(window)[:-1])
    new_ids = _encode(tokenizer, "".join(new_window)[:-1])
    edits = token_edits(old_ids[:-1], new_ids[:-1])
    # the last token (fed at decode time) must survive unchanged and something must change
    if not edits or old_ids[-1] != new_ids[-1] or apply_edits(old_ids[:-1], edits) != new_ids[:-1]:
        return None
    return CodeEditSample(source=f"{path.relative_to(root)}:{start + 1}-{t}", kind=kind,
                          old_ids=old_ids, new_ids=new_ids, edits=edits, target=lines[t].rstrip("\n"),
                          n_edited_lines=sum(max(e - s, len(r)) for s, e, r in ops))


@torch.no_grad()
def next_line(text: str) -> tuple[str, bool]:
    """The first non-blank line after the first newline of `text`, and whether it is complete
    (a newline ends it). `text` continues a prompt that stops before its last line break."""
    parts = text.split("\n")[1:]
    for i, part in enumerate(parts):
        if part.strip():
            return part, i + 1 < len(parts)
    return "", False


@torch.no_grad()
def greedy_line(model: nn.Module, tokenizer: Any, cache: PositionedKVCache, next_id: int,
                max_new_tokens: int = 48) -> tuple[str, int]:
    """Feed `next_id` at `cache.next_position`, decode greedily and return `(next_line(text),
    tokens generated)`, stopping once that line is complete, at EOS, or after `max_new_tokens`.
    Mutates `cache` (appends every decoded token but the last).

    The loop is `lcx.hf.generate.greedy_decode_ref` over the cache itself, not
    `lcx.engine.Engine`: what this eval measures is decoding *from the edited cache* each
    strategy produced (PIE's re-rotated keys, `conflict`'s stale ones), and the engine only
    builds its cache by prefilling token ids, which would be `recompute` for every strategy.

    The prompt ends before the line break of its last line, not after it: BPE vocabularies
    merge a newline with the next line's indentation ("\\n" + 7 spaces is one SmolLM2 token),
    so a prompt ending in a bare "\\n" token is out of distribution for an indented line.
    """
    dev = cache.token_ids.device
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []

    def line_done(tok: torch.Tensor) -> bool:  # tok [1]
        ids.append(int(tok[0]))
        return next_line(tokenizer.decode(ids, skip_special_tokens=True))[1] or ids[-1] == eos

    def feed(tok: torch.Tensor) -> torch.Tensor:  # [1] -> logits [1, V]
        return cache.extend_logits(model, tok[:, None])[1]

    _, logits = cache.extend_logits(model, torch.tensor([[next_id]], device=dev))  # [1, V]
    greedy_decode_ref(feed, logits, max_new_tokens, stop=line_done)
    return next_line(tokenizer.decode(ids, skip_special_tokens=True))[0], len(ids)


def edit_similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.strip(), b.strip(), autojunk=False).ratio()


def exact_match(a: str, b: str) -> bool:
    return a.strip() == b.strip()


@dataclass
class SampleResult:
    sample: dict
    completions: dict[str, str] = field(default_factory=dict)
    cost: dict[str, dict] = field(default_factory=dict)


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer: Any, samples: Sequence[CodeEditSample], *,
             strategies: Sequence[str] = ("recompute", "pie", "conflict"), backend: str = "ref",
             max_new_tokens: int = 48, timing_repeats: int = 1, log: Any = None) -> list[SampleResult]:
    """Run every strategy on every sample (see the module docstring); recompute must be included.

    With `timing_repeats > 1` each update runs that many times on fresh copies of the cache and
    `wall_s` is the median (all runs in `wall_s_runs`); the completion uses the last run.
    """
    if "recompute" not in strategies:
        raise ValueError("strategies must include 'recompute' (the reference completion)")
    for s in strategies:
        if s not in EDIT_STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}; known: {sorted(EDIT_STRATEGIES)}")
    dev = next(model.parameters()).device
    results = []
    for i, sm in enumerate(samples):
        base = PositionedKVCache.prefill(model, torch.tensor([sm.old_ids[:-1]], device=dev))
        res = SampleResult(sample=sm.to_json())
        for name in strategies:
            walls = []
            for _ in range(max(1, timing_repeats)):
                out = update_cache(model, base.clone(), sm.edits, strategy=name, backend=backend)
                walls.append(out.cost.wall_s)
            out.cost.wall_s = statistics.median(walls)
            if out.cache.token_ids[0].tolist() != sm.new_ids[:-1]:
                raise AssertionError(f"{name} produced the wrong token sequence")
            t0 = time.perf_counter()
            line, n_gen = greedy_line(model, tokenizer, out.cache, sm.new_ids[-1], max_new_tokens)
            res.completions[name] = line
            cost = asdict(out.cost)
            cost.update(decode_tokens=n_gen, decode_s=time.perf_counter() - t0, wall_s_runs=walls)
            res.cost[name] = cost
        results.append(res)
        if log is not None:
            log(f"[{i + 1}/{len(samples)}] {sm.kind:9s} {sm.source}: "
                + "  ".join(f"{n}={res.cost[n]['tokens_encoded']}tok/{res.cost[n]['wall_s']:.2f}s"
                            f"{'' if n == 'recompute' else (' EM' if exact_match(res.completions[n], res.completions['recompute']) else ' ~')}"
                            for n in strategies))
    return results


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(results: Sequence[SampleResult], strategies: Sequence[str] = ("recompute", "pie", "conflict")) -> dict:
    """Per strategy (overall and per edit kind): EM/ES vs recompute and vs the true line, with
    Wilson 95% intervals of the exact-match rates (`*_ci95`); the paired difference of each
    strategy's true-line exact match to recompute's (`em_vs_truth_minus_recompute`, see
    `paired_difference`); compute (sums and medians) and ratios to recompute (sums over the
    same samples)."""
    out: dict[str, Any] = {}
    groups = {"all": list(results)}
    for r in results:
        groups.setdefault(r.sample["kind"], []).append(r)
    for gname, rs in groups.items():
        g: dict[str, Any] = {"n": len(rs)}
        rec_tok = sum(r.cost["recompute"]["tokens_encoded"] for r in rs)
        rec_flops = sum(r.cost["recompute"]["flops"] for r in rs)
        rec_wall = sum(r.cost["recompute"]["wall_s"] for r in rs)
        rec_true = [exact_match(r.completions["recompute"], r.sample["target"]) for r in rs]
        for s in strategies:
            tok = sum(r.cost[s]["tokens_encoded"] for r in rs)
            flops = sum(r.cost[s]["flops"] for r in rs)
            wall = sum(r.cost[s]["wall_s"] for r in rs)
            em_rec = [exact_match(r.completions[s], r.completions["recompute"]) for r in rs]
            em_true = [exact_match(r.completions[s], r.sample["target"]) for r in rs]
            g[s] = {
                "em_vs_recompute": statistics.fmean(em_rec),
                "em_vs_recompute_ci95": wilson_interval(sum(em_rec), len(rs)),
                "es_vs_recompute": statistics.fmean(edit_similarity(r.completions[s], r.completions["recompute"]) for r in rs),
                "em_vs_truth": statistics.fmean(em_true),
                "em_vs_truth_ci95": wilson_interval(sum(em_true), len(rs)),
                "em_vs_truth_count": sum(em_true),
                "es_vs_truth": statistics.fmean(edit_similarity(r.completions[s], r.sample["target"]) for r in rs),
                "tokens_encoded_sum": tok,
                "tokens_encoded_median": _median([r.cost[s]["tokens_encoded"] for r in rs]),
                "flops_sum": flops,
                "wall_s_median": _median([r.cost[s]["wall_s"] for r in rs]),
                "wall_s_sum": wall,
                "tokens_ratio_to_recompute": tok / rec_tok if rec_tok else None,
                "flops_ratio_to_recompute": flops / rec_flops if rec_flops else None,
                "wall_ratio_to_recompute": wall / rec_wall if rec_wall else None,
                "compute_saved_vs_recompute": 1 - flops / rec_flops if rec_flops else None,
            }
            if s != "recompute":
                g[s]["em_vs_truth_minus_recompute"] = paired_difference(em_true, rec_true)
        out[gname] = g
    return out


__all__ = ["CodeEditSample", "EDIT_KINDS", "SampleResult", "edit_similarity", "evaluate", "exact_match",
           "greedy_line", "make_samples", "next_line", "paired_difference", "stdlib_files", "summarize", "token_edits",
           "wilson_interval"]
