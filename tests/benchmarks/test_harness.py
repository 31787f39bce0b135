"""`benchmarks.harness`: the common flags, the run record (frozen config, atomic save after every
case, plot beside the JSON), the module skeleton every `lcx bench` command follows, and the
kernel benchmark's CUDA timing path (`triton.testing.do_bench`) driven on the CPU by a stand-in."""

from __future__ import annotations

import argparse
import dataclasses
import json
from importlib import import_module
from pathlib import Path

import pytest

from benchmarks.harness import OFF, Benchmark, config_dict, figure, replot
from lcx.cli import COMMANDS

BENCH_MODULES = [(path[1], module) for path, module, _ in COMMANDS if path[0] == "bench"]


@dataclasses.dataclass(frozen=True)
class Cfg:
    model: str
    lengths: list[int]


def _parse(bench: Benchmark, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


# ----------------------------------------------------------------------------- flags
def test_common_flags_only_where_declared():
    plain = _parse(Benchmark("x", "d", out="results/x.json"))
    assert vars(plain) == {"out": Path("results/x.json")}  # no --threads, --seed, --no-plot
    full = _parse(Benchmark("x", "d", out="results/x.json", threads="1", seed=0, plot=True))
    assert (full.out, full.threads, full.seed, full.no_plot) == (Path("results/x.json"), 1, 0, False)
    args = _parse(Benchmark("x", "d", out="a.json", threads=None, seed=3, plot=True),
                  "--out", "/tmp/b.json.gz", "--threads", "auto", "--seed", "7", "--no-plot")
    assert (args.out, args.threads, args.seed, args.no_plot) == (Path("/tmp/b.json.gz"), "auto", 7, True)
    assert _parse(Benchmark("x", "d", threads=None)).threads is None  # None: torch's own setting
    assert _parse(Benchmark("x", "d")).out is None  # the benchmark computes its default (per GPU)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_flag_rejects_bad_values(value, capsys):
    for bench in (Benchmark("x", "d", threads=1), Benchmark("x", "d", threads=1, threads_help="server threads")):
        with pytest.raises(SystemExit):
            _parse(bench, "--threads", value)
    assert "threads must be" in capsys.readouterr().err


def test_resolve_threads(monkeypatch):
    bench = Benchmark("x", "d", threads=None)
    assert bench.resolve_threads(argparse.Namespace(threads=None)) is None  # left to torch
    assert bench.resolve_threads(argparse.Namespace(threads=3), apply=False) == 3
    monkeypatch.setenv("LCX_THREADS", "2")
    assert bench.resolve_threads(argparse.Namespace(threads="auto"), apply=False) == 2


def test_command_is_the_module_main():
    seen = []

    def add(p):
        p.add_argument("--n", type=int, default=1)

    bench = Benchmark("toy", "a toy benchmark", "toy: summary.\n\n    lcx bench toy --n 2\n", out="r.json")

    def add_all(p):
        bench.add_arguments(p)
        add(p)

    main = bench.command(add_all, lambda a: seen.append(a) or 5)
    assert main(["--n", "2"]) == 5 and seen[0].n == 2 and seen[0].out == Path("r.json")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_help_epilog_is_the_docstring_after_its_first_paragraph(capsys):
    bench = Benchmark("toy", "a toy benchmark", "toy: summary.\n\n    lcx bench toy --n 2\n")
    with pytest.raises(SystemExit):
        bench.command(bench.add_arguments, lambda a: 0)(["--help"])
    out = capsys.readouterr().out
    assert "usage: lcx bench toy" in out and "lcx bench toy --n 2" in out and "toy: summary." not in out


# ----------------------------------------------------------------------------- the record
def test_config_is_a_frozen_dataclass_or_a_stored_dict():
    assert config_dict(Cfg("m", [1, 2])) == {"model": "m", "lengths": [1, 2]}
    assert config_dict({"model": "m", "merged_from": {}}) == {"model": "m", "merged_from": {}}
    with pytest.raises(TypeError, match="frozen dataclass"):
        config_dict(argparse.Namespace(model="m"))
    with pytest.raises(TypeError):
        config_dict(Cfg)  # the class, not a config

    @dataclasses.dataclass(frozen=True)
    class Ordered:
        b: int = 2
        a: int = 1

        def to_dict(self):
            return {"a": self.a, "b": self.b}

    assert list(config_dict(Ordered())) == ["a", "b"]


def test_save_after_every_case_keeps_a_cut_off_run(tmp_path):
    out = tmp_path / "sub" / "r.json"
    bench = Benchmark("toy", "toy description", out=str(out), record_description="what the record measured")
    rec = bench.start(_parse(bench), Cfg("m", [1, 2, 3]), environment={"device": "cpu"})
    results = {}
    with pytest.raises(RuntimeError):
        for n in rec.progress([1, 2, 3], enabled=False):
            if n == 3:
                raise RuntimeError("cut off")
            results[n] = n * n
            rec.save(results, wall_s=rec.elapsed(3))
    got = json.loads(out.read_text())
    assert list(got) == ["description", "config", "environment", "wall_s", "results"]
    assert got["description"] == "what the record measured"
    assert got["config"] == {"model": "m", "lengths": [1, 2, 3]}
    assert got["results"] == {"1": 1, "2": 4}
    assert got["environment"]["device"] == "cpu" and "sha" in got["environment"]["git"]
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temporary file left behind


def test_finish_writes_the_record_then_the_plot_beside_it(tmp_path, capsys):
    drawn = []

    def plot(record, path):
        drawn.append((record["results"], path))
        path.write_bytes(b"png")

    bench = Benchmark("toy", "toy", out=str(tmp_path / "r.json.gz"), plot=True)
    rec = bench.start(_parse(bench), Cfg("m", [1]))
    record = rec.finish({"a": 1}, plot=plot, summary={"a": "one"})
    assert drawn == [({"a": 1}, tmp_path / "r.png")]  # .json.gz -> .png
    assert list(record) == ["description", "config", "environment", "summary", "results"]
    from lcx.data.io import read_json

    assert read_json(tmp_path / "r.json.gz")["summary"] == {"a": "one"}
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'r.json.gz'}" in out and f"wrote {tmp_path / 'r.png'}" in out
    # --no-plot: the record only
    drawn.clear()
    rec = bench.start(_parse(bench, "--no-plot", "--out", str(tmp_path / "n.json")), Cfg("m", [1]))
    rec.finish({"a": 1}, plot=plot)
    assert drawn == [] and (tmp_path / "n.json").exists() and not (tmp_path / "n.png").exists()


def test_write_any_json_and_replot_from_the_record(tmp_path):
    bench = Benchmark("toy", "toy", out=str(tmp_path / "r.json"), plot=True)
    rec = bench.start(_parse(bench))
    rec.write({"samples": [{"i": 1}, {"i": 2}], "summary": {}}, rows=("samples",))
    assert json.loads((tmp_path / "r.json").read_text())["samples"] == [{"i": 1}, {"i": 2}]

    def plot(record, path):
        with figure(path, 1, 2, figsize=(4, 2), title="t") as (fig, axes):
            axes[0].plot([x["i"] for x in record["samples"]])

    import matplotlib.pyplot as plt

    before = plt.get_fignums()  # (figures another test left open are not this one's)
    assert replot(tmp_path / "r.json", plot) == tmp_path / "r.png"
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG" and plt.get_fignums() == before


def test_figure_closes_and_writes_nothing_when_the_plot_fails(tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()  # (figures another test left open are not this one's)
    with pytest.raises(ZeroDivisionError):
        with figure(tmp_path / "x.png") as (fig, ax):
            1 / 0
    assert not (tmp_path / "x.png").exists() and plt.get_fignums() == before


# ----------------------------------------------------------------------------- every benchmark
@pytest.mark.parametrize("name,module", BENCH_MODULES, ids=[n for n, _ in BENCH_MODULES])
def test_every_bench_module_is_on_the_harness(name, module):
    mod = import_module(module)
    assert isinstance(mod.BENCH, Benchmark) and mod.BENCH.name == name
    assert mod.BENCH.description == mod.DESCRIPTION
    assert mod.BENCH.out is not None or mod.BENCH.out_help, "a computed default --out says what it is"
    cfg = getattr(mod, "Config", None)
    if cfg is not None:  # the record's config: a frozen dataclass
        assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    dests = {a.dest for a in p._actions}
    assert "out" in dests
    assert ("threads" in dests) == (mod.BENCH.threads is not OFF)
    assert ("no_plot" in dests) == mod.BENCH.plot


# ----------------------------------------------------------------------------- kernel timing
class FakeDoBench:
    """triton.testing.do_bench's call pattern with a fixed time per call (ms): one call, a 5-call
    estimate, max(1, warmup / t) warm-up calls, max(1, rep / t) timed calls; return_mode 'all'
    gives every timed call's time."""

    def __init__(self, t: float):
        self.t, self.reps = t, []

    def __call__(self, fn, warmup=25, rep=100, return_mode="mean"):
        for _ in range(1 + 5 + max(1, int(warmup / self.t))):
            fn()
        n = max(1, int(rep / self.t))
        self.reps.append(rep)
        for _ in range(n):
            fn()
        times = [self.t] * n
        return times if return_mode == "all" else self.t


@pytest.mark.parametrize("t_ms,repeats,expect_calls", [(0.01, 20, 10000), (50.0, 10, 11), (2.0, 3, 50)])
def test_kernel_timing_through_do_bench(t_ms, repeats, expect_calls):
    """The CUDA path's logic: our warm-up calls first (compilation outside do_bench's estimate), a
    probe, then a budget of max(100 ms, (repeats + 1) t); every call takes the next input buffer."""
    from benchmarks.harness import DO_BENCH_MIN_MS, Prepared, time_case

    seen = []
    prep = Prepared(run=seen.append, n_buffers=4, bytes=1.0, flops=0.0)
    fake = FakeDoBench(t_ms)
    times = time_case(prep, "cpu", warmup=2, repeats=repeats, do_bench=fake)
    assert fake.reps == [0, max(DO_BENCH_MIN_MS, (repeats + 1) * t_ms)]
    assert len(times) == expect_calls and all(isinstance(x, float) and x == t_ms for x in times)
    assert len(times) >= min(repeats, int(DO_BENCH_MIN_MS / t_ms))
    assert seen == list(range(len(seen))) and seen[:2] == [0, 1]  # warm-up 0, 1, then 2, 3, ... in order


def test_kernel_timing_on_the_cpu_is_wall_clock_of_repeats_calls():
    from benchmarks.harness import Prepared, time_case

    seen = []
    times = time_case(Prepared(run=seen.append, n_buffers=1, bytes=1.0, flops=0.0), "cpu", warmup=1, repeats=3)
    assert seen == [0, 1, 2, 3] and len(times) == 3 and all(t >= 0 for t in times)


# ----------------------------------------------------------------------------- committed records
ROOT = Path(__file__).resolve().parents[2]
# The committed record of each benchmark whose config is its `Config` (the same keys, in order):
# what `--resume`, `--merge`, `--compare` and the README read back.
COMMITTED = [("threads", "threads_cpu.json"), ("prefill", "prefill_cpu.json"), ("attention", "attention_cpu.json"),
             ("decode", "decode_cpu.json"), ("decode", "decode_cpu_32k.json"), ("decode", "gemma3-270m/decode_cpu.json"),
             ("extrapolation", "extrapolation_tiny.json"), ("swat", "swat_vs_softmax.json"),
             ("scale", "scale/cpu.json"), ("pie", "pie_code_edit.json"), ("lmeval", "lmeval/lmeval_results.json"),
             ("serving", "serving_cpu.json"), ("attention", "attention_flash_32k_cpu.json"),
             ("prefix", "prefix_cpu.json"), ("allocator", "allocator_cpu.json"),  # (prefill_engine_cpu.json: `--engine` mode, its own config)
             *[("prefill", f"gemma3-270m/prefill_as_loaded_{n}.json") for n in (2048, 8192, 16384)],
             ("prefill", "gemma3-270m/prefill_dynamic_8192.json")]


@pytest.mark.parametrize("name,path", COMMITTED, ids=[p for _, p in COMMITTED])
def test_committed_records_have_the_config_of_their_benchmark(name, path):
    from lcx.configs import strict_from_dict
    from lcx.data.io import json_path, read_json

    file = json_path(ROOT / "results" / path)
    if not file.exists():
        pytest.skip(f"{file} is not in this checkout")
    stored = read_json(file)["config"]
    cfg = strict_from_dict(import_module(f"benchmarks.{name}").Config, stored)  # no key unknown or missing
    assert list(config_dict(cfg)) == list(stored)  # written back in the same order
    assert config_dict(cfg) == stored
