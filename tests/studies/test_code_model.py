"""The code-model pipeline for the PIE benchmark: the by-package stdlib split, the trainer's
`stdlib-code` corpus and bf16 autocast, the benchmark's confidence intervals, split guard,
`--resume` and `--rescore`. Tiny models only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from studies.code_edit import SampleResult, paired_difference, stdlib_files, summarize, wilson_interval
from lcx.data.code import CODE_SPLITS, code_split, code_unit, load_code_corpus, split_of, split_record, stdlib_root

ROOT = Path(__file__).resolve().parents[2]

# The rule's output for a few packages, written down by hand: a change to SPLIT_ID, the
# fractions or the hash moves some of them (and silently re-mixes train and eval otherwise).
EXPECTED_SPLIT = {"argparse": "eval", "threading": "eval", "unittest": "eval", "zipfile": "eval",
                  "asyncio": "val", "encodings": "train", "email": "train", "idlelib": "train",
                  "json": "train", "typing": "train", "collections": "train", "os": "train"}


def _bench():
    from benchmarks import pie

    return pie


# ------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("unit", sorted(EXPECTED_SPLIT))
def test_split_of_hand_written(unit):
    assert split_of(unit) == EXPECTED_SPLIT[unit]


@pytest.mark.parametrize("rel, unit", [("asyncio/events.py", "asyncio"), ("argparse.py", "argparse"),
                                       ("email/mime/text.py", "email"), ("__future__.py", "__future__")])
def test_code_unit(rel, unit):
    assert code_unit(rel) == unit


def test_split_is_by_package_and_disjoint():
    split = code_split()
    root = stdlib_root()
    units = {s: {code_unit(p.relative_to(root)) for p in split[s]} for s in CODE_SPLITS}
    assert all(split[s] for s in CODE_SPLITS)
    for a in CODE_SPLITS:
        for b in CODE_SPLITS:
            if a < b:
                assert not units[a] & units[b], (a, b)
                assert not set(split[a]) & set(split[b])
    rec = split_record(split)
    assert rec["eval"]["n_files"] == len(split["eval"]) and rec["train"]["units"] == sorted(units["train"])
    assert split_record(code_split())["eval"]["files_sha256"] == rec["eval"]["files_sha256"]  # deterministic


@pytest.mark.slow
def test_eval_files_and_training_corpus_never_meet():
    ev = stdlib_files(split="eval")
    assert ev and set(ev) <= set(stdlib_files())
    assert all(split_of(code_unit(p.relative_to(stdlib_root()))) == "eval" for p in ev)
    from lcx.train.lm import CORPORA

    eval_names = {str(p.relative_to(stdlib_root())) for p in code_split()["eval"]}
    for part in ("train", "held_out"):
        docs = CORPORA["stdlib-code"](part)
        assert docs and not {d.name for d in docs} & eval_names
    assert all(split_of(d.work) == "val" for d in load_code_corpus("val"))
    with pytest.raises(ValueError, match="unknown code split"):
        load_code_corpus("test")


# ------------------------------------------------------------------------------- statistics
def test_wilson_interval_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(0, 0) is None


def _pairs(both, x_only, y_only, neither):
    x = [1] * both + [1] * x_only + [0] * y_only + [0] * neither
    y = [1] * both + [0] * x_only + [1] * y_only + [0] * neither
    return [bool(v) for v in x], [bool(v) for v in y]


def test_paired_difference_counts_and_mcnemar():
    d = paired_difference(*_pairs(12, 9, 2, 21))
    assert (d["n"], d["both"], d["x_only"], d["y_only"], d["neither"]) == (44, 12, 9, 2, 21)
    assert d["diff"] == pytest.approx(7 / 44)
    # exact McNemar: 2 * P(Bin(11, 1/2) <= 2) = 2 * (1 + 11 + 55) / 2**11
    assert d["mcnemar_p"] == pytest.approx(134 / 2048)
    lo, hi = d["ci95"]
    assert lo < d["diff"] < hi and 0 < lo and hi < 0.35
    swapped = paired_difference(*reversed(_pairs(12, 9, 2, 21)))
    assert swapped["ci95"] == pytest.approx([-hi, -lo])  # symmetric in the two arms


def test_paired_difference_identical_arms():
    x, _ = _pairs(5, 0, 0, 95)
    d = paired_difference(x, x)
    assert d["diff"] == 0 and d["mcnemar_p"] == 1.0 and d["ci95"][0] < 0 < d["ci95"][1]
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([True], [True, False])


def _result(kind, target, rec, pie, conflict):
    cost = {"tokens_encoded": 10, "flops": 100.0, "wall_s": 1.0}
    return SampleResult(sample={"kind": kind, "target": target}, completions={"recompute": rec, "pie": pie,
                                                                             "conflict": conflict},
                        cost={s: dict(cost) for s in ("recompute", "pie", "conflict")})


def test_summarize_intervals_hand_counted():
    rs = [_result("insertion", "x = 1", "x = 1", "x = 1", "y"),
          _result("deletion", "  z()", "z()", "w()", "z()"),
          _result("insertion", "a", "b", "a", "b"),
          _result("deletion", "q", "r", "r", "r")]
    s = summarize(rs)["all"]
    assert s["recompute"]["em_vs_truth"] == 0.5 and tuple(s["recompute"]["em_vs_truth_ci95"]) == wilson_interval(2, 4)
    assert s["pie"]["em_vs_truth_count"] == 2 and s["pie"]["em_vs_recompute"] == 0.5
    d = s["pie"]["em_vs_truth_minus_recompute"]
    assert (d["x_only"], d["y_only"], d["both"], d["neither"]) == (1, 1, 1, 1) and d["diff"] == 0
    assert "em_vs_truth_minus_recompute" not in s["recompute"]


# ------------------------------------------------------------------ third-party code (site_code)
def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _code(name: str, n: int = 60) -> str:
    """A plausible, unique Python file of roughly 40 * n bytes."""
    return "".join(f"def {name}_function_number_{i}(argument_{i}, other):\n    return {name}_{i} * {i} + other\n"
                   for i in range(n))


def test_site_code_filters_and_decontaminates(tmp_path):
    from lcx.data.code import site_code

    ref = _write(tmp_path / "stdlib" / "heldout.py", _code("reference"))
    ref_lines = [ln for ln in ref.read_text().splitlines() if ln.startswith("def")]
    site = tmp_path / "site"
    _write(site / "good" / "a.py", _code("good_a"))
    _write(site / "good" / "b.py", _code("good_b"))
    _write(site / "zdup" / "a.py", _code("good_a"))                       # a later exact duplicate of good/a.py
    _write(site / "copy" / "a.py", _code("copy") + "\n".join(ref_lines[:3]) + "\n")  # 3 held-out lines
    _write(site / "near" / "a.py", _code("near", 200) + "\n".join(ref_lines[:2]) + "\n")  # 2 of 202: kept
    _write(site / "few" / "a.py", _code("few") + "\n".join(ref_lines[:2]) + "\n")  # 2 of 62 (> 2%): dropped
    _write(site / "multiprocess" / "pool.py", _code("backport"))          # a stdlib copy, by name
    _write(site / "lib" / "_vendor" / "x.py", _code("vendored"))          # a vendored directory
    _write(site / "lib" / "tests" / "t.py", _code("tested"))              # tests
    _write(site / "gen" / "a.py", "# Generated by a tool. Do not edit.\n" + _code("gen"))
    _write(site / "tiny" / "a.py", "x = 1\n")                            # under 1 kB
    _write(site / "wide" / "a.py", "x = '" + "a" * 1200 + "'\n" + _code("wide"))  # a 1200-char line
    _write(site / "data" / "a.py", "x = [\n" + "    [[], (), {}, [], (), {}, [], ()],\n" * 100 + "]\n")  # punctuation
    _write(site / "big" / "a.py", _code("big_a", 3000))                    # over 100 kB
    for i in range(10):  # 10 x ~2.6 kB in one package: the 200 kB budget is not reached
        _write(site / "many" / f"m{i}.py", _code(f"many{i}"))
    sc = site_code(site, reference=[ref])
    names = {d.name for d in sc.documents}
    assert {"good/a.py", "good/b.py", "near/a.py"} <= names
    assert not names & {"zdup/a.py", "copy/a.py", "few/a.py", "multiprocess/pool.py", "lib/_vendor/x.py", "lib/tests/t.py",
                        "gen/a.py", "tiny/a.py", "wide/a.py", "data/a.py", "big/a.py"}
    assert sum(n.startswith("many/") for n in names) == 10
    r = sc.record
    assert r["n_files"] == len(names) and r["files"] == sorted(names)
    assert r["dropped"] == {"alnum": 1, "backport": 1, "duplicate": 1, "generated": 1, "line_length": 1,
                            "shares_reference_lines": 2, "size": 2}
    assert {d.work for d in sc.documents} == {"good", "near", "many"}
    assert site_code(site, reference=[ref]).record["files_sha256"] == r["files_sha256"]  # deterministic


def test_site_code_package_budget(tmp_path, monkeypatch):
    import lcx.data.code as code

    for i in range(6):
        _write(tmp_path / "pkg" / f"m{i}.py", _code(f"m{i}"))            # equal sizes
    size = len(_code("m0"))
    monkeypatch.setattr(code, "SITE_UNIT_BYTES", int(2.5 * size))
    sc = code.site_code(tmp_path, reference=[])
    assert len(sc.documents) == 2 and sc.record["dropped"] == {"package_budget": 4}
    assert sum(len(d.text) for d in sc.documents) <= 2.5 * size


@pytest.mark.slow
def test_site_code_never_shares_heldout_lines():
    """On this machine's site-packages: no kept file shares more than 2 long lines with the
    stdlib's val and eval packages (the rule, checked on the real data)."""
    from lcx.data.code import SITE_MIN_LINE, default_site_code

    split = code_split()
    ref = set()
    for p in split["val"] + split["eval"]:
        try:
            ref.update(s for s in (ln.strip() for ln in p.read_text(encoding="utf-8").splitlines())
                       if len(s) >= SITE_MIN_LINE)
        except (UnicodeDecodeError, OSError):
            pass
    sc = default_site_code()
    assert sc.documents, "no third-party code found"
    assert default_site_code() is sc  # computed once per process (corpus loader and run record)
    worst = max(sum(s.strip() in ref for s in d.text.splitlines() if len(s.strip()) >= SITE_MIN_LINE)
                for d in sc.documents)
    assert worst <= 2
    assert not {d.work for d in sc.documents} & {"multiprocess", "typing_extensions"}


# ------------------------------------------------------------------------------- the trainer
def test_train_config_corpus_and_autocast_validation():
    from lcx.train.lm import TrainConfig

    assert TrainConfig(corpus="stdlib-code", autocast="bfloat16").autocast == "bfloat16"
    assert TrainConfig(corpus="python-code").corpus == "python-code"
    with pytest.raises(ValueError, match="corpus"):
        TrainConfig(corpus="stdlib")
    with pytest.raises(ValueError, match="autocast"):
        TrainConfig(autocast="float16")


def test_autocast_training_on_code_and_resume_of_an_older_state(tmp_path):
    from lcx.data import encode_documents, train_tokenizer
    from lcx.train.lm import CORPORA, ModelConfig, TrainConfig, train

    docs = CORPORA["stdlib-code"]("train")[::40]
    texts = [d.text[:8000] for d in docs]
    tok = train_tokenizer(texts, vocab_size=320)
    ids = encode_documents(tok, texts)
    mc = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    cfg = TrainConfig(model=mc, steps=4, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, eval_every=2,
                      ckpt_every=2, val_windows=4, corpus="stdlib-code", autocast="bfloat16")
    torch.set_num_threads(1)
    kw = dict(tokenizer=tok, train_ids=ids[:20000], val_ids=ids[20000:], progress=False, plot=False)
    part = train(cfg, tmp_path, stop_after=2, **kw)
    assert all(math.isfinite(v) for v in part.log["loss"]) and part.log["config"]["autocast"] == "bfloat16"
    # a state written before `corpus`/`autocast` existed (their defaults) resumes a default config
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    old = cfg.replace(corpus="text", autocast=None)
    state["config"] = {k: v for k, v in old.to_dict().items() if k not in ("corpus", "autocast")}
    torch.save(state, tmp_path / "state.pt")
    res = train(old, tmp_path, resume=True, **kw)
    assert res.log["resumed_at_step"] == [2] and len(res.log["loss"]) == 4


# ------------------------------------------------------------------------------- the benchmark
def test_split_guard(tmp_path):
    bench = _bench()
    assert bench.code_split_guard(str(tmp_path), "all", []) is None  # no train_config.json
    rec = split_record()
    (tmp_path / "train_config.json").write_text(json.dumps({"code_split": rec}))
    ev = code_split()["eval"]
    with pytest.raises(SystemExit, match="--split eval"):
        bench.code_split_guard(str(tmp_path), "all", ev)
    assert bench.code_split_guard(str(tmp_path), "eval", ev)["checked_no_overlap_with_eval_files"] == len(ev)
    rec["train"]["files"].append(str(ev[0].relative_to(stdlib_root())))  # a leaked eval file
    (tmp_path / "train_config.json").write_text(json.dumps({"code_split": rec}))
    with pytest.raises(SystemExit, match="training data"):
        bench.code_split_guard(str(tmp_path), "eval", ev)


def test_split_guard_follows_the_init_chain(tmp_path):
    """A later fine-tuning stage inherits its earlier stages' data: a leak two stages back is caught."""
    bench = _bench()
    ev = code_split()["eval"]
    clean, leaked = split_record(), split_record()
    leaked["train"]["files"].append(str(ev[0].relative_to(stdlib_root())))
    s1, s2, s3 = (tmp_path / f"s{i}" for i in (1, 2, 3))
    for d, rec, init in ((s1, leaked, None), (s2, clean, s1), (s3, clean, s2)):
        d.mkdir()
        (d / "train_config.json").write_text(json.dumps(
            {"code_split": rec, "init": {"source": str(init), "path": str(init)} if init else None}))
    with pytest.raises(SystemExit, match="training data"):
        bench.code_split_guard(str(s3), "eval", ev)
    (s1 / "train_config.json").write_text(json.dumps({"code_split": clean}))
    assert bench.code_split_guard(str(s3), "eval", ev)["stages_checked"] == 3
    (s2 / "train_config.json").write_text(json.dumps({"code_split": clean, "init": {"path": str(s3)}}))  # a cycle
    assert bench.code_split_guard(str(s3), "eval", ev)["stages_checked"] == 2


def test_bench_resume_and_rescore(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "pie.json"
    args = ["--model", "tiny-random", "--samples", "2", "--ctx-tokens", "120", "--split", "eval",
            "--max-new-tokens", "3", "--out", str(out), "--no-plot", "--threads", "1"]
    assert bench.main(args) == 0
    first = json.loads(out.read_text())
    assert first["complete"] and len(first["samples"]) == 2
    s = first["summary"]["ctx_120"]["all"]
    assert s["pie"]["em_vs_truth_ci95"] is not None and "em_vs_truth_minus_recompute" in s["conflict"]
    sources = {x["sample"]["source"].split(":")[0] for x in first["samples"]}
    assert all(split_of(code_unit(p)) == "eval" for p in sources)
    # --resume keeps finished samples; more --samples extends the run (samples are drawn in order)
    assert bench.main([*args, "--resume"]) == 0
    assert json.loads(out.read_text())["samples"] == first["samples"]
    with pytest.raises(SystemExit, match="other settings"):
        bench.main([*args, "--seed", "1", "--resume"])
    more = [*args[:3], "3", *args[4:], "--resume"]
    assert bench.main(more) == 0
    again = json.loads(out.read_text())
    assert again["samples"][:2] == first["samples"] and len(again["samples"]) == 3 and again["resumed"] == [2, 2]
    # rescore: drop the summary, recompute it from the stored samples
    broken = dict(again, summary={})
    out.write_text(json.dumps(broken))
    assert bench.main(["--rescore", str(out), "--no-plot"]) == 0
    assert json.loads(out.read_text())["summary"] == again["summary"]
    # a record stored gzipped (as the committed ones are) is found under its .json name, resumed
    # and rewritten gzipped, and compared like a plain one
    from lcx.data import io

    gz = out.with_name("pie.json.gz")
    io.atomic_write_json(gz, again, rows=("samples",))
    out.unlink()
    assert bench.main([*more[:-1], "--resume"]) == 0
    assert not out.exists() and io.read_json(gz)["samples"] == again["samples"]
    assert bench.main(["--compare", str(out), str(gz), "--out", str(tmp_path / "cmp.json")]) == 0


def test_bench_merge_of_per_context_runs(tmp_path):
    """Two processes, one context length each, merge into the record one process would write."""
    bench = _bench()
    common = ["--model", "tiny-random", "--samples", "2", "--split", "eval", "--max-new-tokens", "3",
              "--no-plot", "--threads", "1", "--strategies", "recompute", "pie"]
    a, b, both, merged = (tmp_path / f"{n}.json" for n in ("a", "b", "both", "merged"))
    assert bench.main([*common, "--ctx-tokens", "120", "--out", str(a)]) == 0
    assert bench.main([*common, "--ctx-tokens", "160", "--out", str(b)]) == 0
    assert bench.main([*common, "--ctx-tokens", "120", "160", "--out", str(both)]) == 0
    assert bench.main(["--merge", str(a), str(b), "--out", str(merged), "--no-plot"]) == 0
    m, one = json.loads(merged.read_text()), json.loads(both.read_text())
    assert m["config"]["ctx_tokens"] == [120, 160] and len(m["merged_from"]) == 2

    def strip(rec):  # wall times differ between runs; everything else must not
        return [{k: v for k, v in x.items() if k != "cost"} for x in rec["samples"]]

    assert strip(m) == strip(one)
    assert m["summary"]["all_contexts"]["all"]["pie"]["em_vs_truth"] == \
        one["summary"]["all_contexts"]["all"]["pie"]["em_vs_truth"]
    with pytest.raises(SystemExit, match="overlap"):
        bench.main(["--merge", str(a), str(a), "--out", str(merged)])
    c = tmp_path / "c.json"
    assert bench.main([*common, "--ctx-tokens", "200", "--seed", "3", "--out", str(c)]) == 0
    with pytest.raises(SystemExit, match="seed"):
        bench.main(["--merge", str(a), str(c), "--out", str(merged)])


def test_bench_compare_of_two_models_on_the_same_samples(tmp_path, capsys):
    """`--compare`: per strategy, both models' exact match and the paired difference; refuses runs
    of other settings or other samples."""
    bench = _bench()
    common = ["--model", "tiny-random", "--samples", "3", "--ctx-tokens", "120", "--split", "eval",
              "--max-new-tokens", "3", "--no-plot", "--threads", "1", "--strategies", "recompute", "pie"]
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    assert bench.main([*common, "--out", str(a)]) == 0
    rec = json.loads(a.read_text())
    # a "second model" that gets samples 0 and 2 right with recompute (the true line as its completion)
    second = json.loads(json.dumps(rec))
    second["config"]["model"] = "other-model"
    for i in (0, 2):
        x = second["samples"][i]
        x["completions"]["recompute"] = "  " + x["sample"]["target"].strip()  # exact match strips
    b.write_text(json.dumps(second))
    assert bench.main(["--compare", str(a), str(b), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["models"] == ["tiny-random", "other-model"]
    row = got["summary"]["all_contexts"]["recompute"]
    first_em = [x["completions"]["recompute"].strip() == x["sample"]["target"].strip() for x in rec["samples"]]
    assert row["em_vs_truth_1"] == pytest.approx(sum(first_em) / 3)
    assert row["em_vs_truth_2"] == pytest.approx((2 + (first_em[1])) / 3)
    d = row["second_minus_first"]
    assert d["x_only"] == sum(1 for i in (0, 2) if not first_em[i]) and d["y_only"] == 0
    assert got["summary"]["ctx_120"]["pie"]["second_minus_first"]["diff"] == 0.0  # pie untouched
    assert "exact match of the true line" in capsys.readouterr().out
    # guards: no --out (the default is the benchmark's own record), other settings, other samples
    with pytest.raises(SystemExit, match="give --out"):
        bench.main(["--compare", str(a), str(b)])
    c = tmp_path / "c.json"
    assert bench.main([*common, "--seed", "5", "--out", str(c)]) == 0
    with pytest.raises(SystemExit, match="seed"):
        bench.main(["--compare", str(a), str(c), "--out", str(out)])
    moved = json.loads(json.dumps(rec))
    moved["samples"][1]["sample"]["target"] += " x"
    c.write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="differs between the runs"):
        bench.main(["--compare", str(a), str(c), "--out", str(out)])
    moved["samples"] = moved["samples"][:2]
    c.write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="different samples"):
        bench.main(["--compare", str(a), str(c), "--out", str(out)])
