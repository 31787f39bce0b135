"""Perplexity by length: window selection, exp(mean NLL) by hand, RoPE specs, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lcx.data import train_tokenizer
from lcx.eval.perplexity import perplexity_by_length, select_windows
from lcx.train.lm import ModelConfig, build_model

# (n_tokens, lengths, max_tokens) -> hand-computed window starts. C = max(lengths) tokens per
# chunk; k = max_tokens // C chunks spread evenly over the n_tokens // C available ones.
WINDOW_CASES = [
    # C=40, 25 chunks available, k=3 -> chunks 0, 12, 24 (token offsets 0, 480, 960)
    ((1000, [10, 40], 120), {10: [0, 10, 20, 30, 480, 490, 500, 510, 960, 970, 980, 990], 40: [0, 480, 960]}),
    # odd lengths: C=7, 3 chunks available, budget allows 2 -> chunks 0 and 2; 7 // 3 = 2 windows
    ((23, [3, 7], 14), {3: [0, 3, 14, 17], 7: [0, 14]}),
    # budget below C still gives one chunk
    ((100, [2, 50], 10), {2: list(range(0, 50, 2)), 50: [0]}),
    # budget above the stream: every chunk
    ((10, [5], 10_000), {5: [0, 5]}),
]

MICRO = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=16)
TEXTS = [
    "Now it came to pass in the days when the judges ruled, that there was a famine in the land. " * 6,
    "When shall we three meet again in thunder, lightning, or in rain? When the hurlyburly's done. " * 6,
]


@pytest.fixture(scope="module")
def micro():
    tok = train_tokenizer(TEXTS, vocab_size=300)
    model = build_model(MICRO, seed=3, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id).eval()
    # At init (std 0.02) attention is almost uniform and positions barely matter; sharpen the
    # q/k projections so a RoPE change moves the NLL clearly.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    return model, tok


@pytest.mark.parametrize("args, expected", WINDOW_CASES, ids=lambda v: str(v)[:30])
def test_select_windows_hand_cases(args, expected):
    assert select_windows(*args) == expected


@pytest.mark.parametrize("n_tokens, lengths, budget", [(10_000, [63, 64, 256], 1024), (4097, [2, 217, 1000], 3000),
                                                        (4097, [1, 4097][1:], 1), (5000, [3, 1000], 999)])
def test_windows_non_overlapping_within_budget(n_tokens, lengths, budget):
    starts = select_windows(n_tokens, lengths, budget)
    C = max(lengths)
    k = min(n_tokens // C, max(1, budget // C))
    assert set(starts) == set(lengths)  # every length gets windows (the loop below checks them)
    for n, st in starts.items():
        assert len(st) == k * (C // n)
        spans = sorted((s, s + n) for s in st)
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))  # disjoint
        assert spans[-1][1] <= n_tokens
        assert len(st) * n <= max(budget, C)
        # every window lies inside one of the k chunks shared by all lengths
        assert {s // C for s in st} == {s // C for s in starts[C]}
        assert all(s // C == (s + n - 1) // C for s in st)


def test_select_windows_errors():
    with pytest.raises(ValueError, match="needs at least"):
        select_windows(10, [16], 100)
    with pytest.raises(ValueError, match=">= 2"):
        select_windows(100, [1, 8], 100)


def test_perplexity_is_exp_mean_nll_by_hand(micro):
    model, tok = micro
    lengths, budget = [4, 16], 48
    res = perplexity_by_length(model, tok, TEXTS, lengths, max_tokens_per_length=budget, batch_size=2,
                               tail=3, progress=False)
    # By hand: the same stream, the documented windows, one window at a time, float64 log-softmax.
    ids = []
    for t in TEXTS:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor(ids)
    starts = select_windows(len(ids), lengths, budget)
    assert len(starts[16]) == 3 and len(starts[4]) == 12
    for n in lengths:
        nlls, tails = [], []
        for s in starts[n]:
            w = ids[s : s + n]
            with torch.no_grad():
                logp = torch.log_softmax(model(w[None]).logits[0].double(), -1)  # [n, V]
            nll = [-logp[p - 1, w[p]].item() for p in range(1, n)]  # every token but the first
            nlls += nll
            tails += nll[-3:]
        r = res[n]
        assert r.tokens == len(nlls) == len(starts[n]) * (n - 1)
        assert r.nll == pytest.approx(sum(nlls) / len(nlls), rel=1e-6)
        assert r.ppl == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-6)
        assert r.ppl == pytest.approx(math.exp(r.nll), rel=1e-12)
        assert r.tail_tokens == len(tails) and r.tail_nll == pytest.approx(sum(tails) / len(tails), rel=1e-6)
    assert list(res) == lengths


def test_tail_covers_the_whole_window_when_longer(micro):
    model, tok = micro
    r = perplexity_by_length(model, tok, TEXTS, [8], max_tokens_per_length=64, tail=256, progress=False)[8]
    assert r.tail_tokens == r.tokens and r.tail_nll == r.nll and r.tail == 7


def test_spec_is_applied_and_removed(micro):
    from lcx.hf.rope_patch import current_spec

    model, tok = micro
    kw = dict(max_tokens_per_length=64, progress=False)
    base = perplexity_by_length(model, tok, TEXTS, [8, 32], **kw)
    same = perplexity_by_length(model, tok, TEXTS, [8, 32], spec={"rope_type": "default"}, **kw)
    lin = perplexity_by_length(model, tok, TEXTS, [8, 32], spec={"rope_type": "linear", "factor": 4}, **kw)
    assert current_spec(model) is None  # restored
    for n in (8, 32):
        assert same[n].nll == pytest.approx(base[n].nll, rel=1e-6)
        assert abs(lin[n].nll - base[n].nll) > 1e-3, (lin[n].nll, base[n].nll)
    # batch size does not change the numbers
    b1 = perplexity_by_length(model, tok, TEXTS, [8, 32], batch_size=1, **kw)
    assert all(b1[n].nll == pytest.approx(base[n].nll, rel=1e-6) for n in (8, 32))


# ------------------------------------------------------------------------------------ CLI

@pytest.fixture(scope="module")
def micro_dir(micro, tmp_path_factory):
    model, tok = micro
    d = tmp_path_factory.mktemp("micro-ppl")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    (d / "text.txt").write_text(" ".join(TEXTS))
    return d


def test_cli_eval_ppl_help(capsys):
    from lcx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "ppl", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--rope", "--factor", "--rope-param", "--lengths", "--out", "--truncate-length"):
        assert flag in out


def test_cli_eval_ppl_runs_and_writes_json(micro_dir, tmp_path, capsys):
    from lcx.cli import main

    out = tmp_path / "r.json"
    rc = main(["eval", "ppl", "--model", str(micro_dir), "--text-file", str(micro_dir / "text.txt"),
               "--rope", "yarn", "--factor", "4", "--rope-param", "beta_fast=16", "--lengths", "8,32",
               "--max-tokens", "64", "--out", str(out), "--no-progress"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["spec"]["rope_type"] == "yarn" and rec["spec"]["beta_fast"] == 16
    assert rec["spec"]["original_max_position_embeddings"] == 16  # filled from the model
    assert [r["length"] for r in rec["results"]] == [8, 32]
    assert "yarn(s=4)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, match", [
    (["--rope", "yarn", "--factor", "0.5"], "factor must be >= 1"),
    (["--rope", "yarn", "--factor", "4", "--rope-param", "nonsense=1"], "unknown RoPE key"),
    (["--rope", "linear"], "requires 'factor'"),
    (["--rope", "linear", "--factor", "2", "--beta-fast", "4"], "does not apply"),
    (["--factor", "2"], "without --rope"),
    (["--rope", "yarn", "--rope-param", "factor"], "KEY=VALUE"),
])
def test_cli_invalid_spec_is_a_clear_error(micro_dir, capsys, flags, match):
    from lcx.cli import main

    rc = main(["eval", "ppl", "--model", str(micro_dir), "--text-file", str(micro_dir / "text.txt"),
               "--lengths", "8", "--no-progress", *flags])
    assert rc == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lcx: error:") and match in last, err


def test_demo_quick_on_the_bundled_model(tmp_path, capsys):
    from lcx.cli import main

    # "default" is the demo's old name of the `vanilla` preset, still accepted
    rc = main(["demo", "--quick", "--presets", "default,dynamic", "--max-tokens", "1024", "--threads", "2",
               "--out", str(tmp_path / "demo"), "--no-progress"])
    assert rc == 0
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert rec["config"]["methods"]["vanilla"] is None and rec["git"]["sha"]
    d, dyn = (rec["results"][m] for m in ("vanilla", "dynamic"))
    assert [r["length"] for r in d] == [256, 1024]
    # dynamic NTK leaves the basis unscaled up to the training length: same numbers at 256
    assert dyn[0]["nll"] == pytest.approx(d[0]["nll"], rel=1e-5)
    assert d[0]["ppl"] < 200  # a trained model, far better than the 4096-way uniform guess
    assert "vanilla" in capsys.readouterr().out
