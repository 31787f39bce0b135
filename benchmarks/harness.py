"""The one skeleton of an `lcx bench` command: common flags, a frozen config, the run record, a plot.

A benchmark module keeps what is its own (cases, measurement, table, plot) and declares the rest:

    BENCH = Benchmark("prefill", DESCRIPTION, __doc__, out="results/prefill_cpu.json", threads="1")

    @dataclass(frozen=True)
    class Config:                      # the resolved settings: the record's "config"
        model: str
        length: int

    def add_arguments(p):              # `lcx bench prefill` (lcx.cli) and main() both call it
        BENCH.add_arguments(p)         # --out, --threads, --seed, --no-plot, help epilog
        p.add_argument("--model", ...)

    def run(args):
        threads = BENCH.resolve_threads(args)  # int|auto resolved (and applied to torch) once
        rec = BENCH.start(args, Config(args.model, args.length))
        for case in rec.progress(cases, unit="case"):
            results[case] = measure(case)
            rec.save(results)          # atomically, after every case: a cut-off run keeps them
        print(table(results))
        rec.finish(results, plot=plot) # the record (path printed), then plot(record, <out>.png)

    main = BENCH.command(add_arguments, run)   # `python -m benchmarks.prefill ...`

The record is `benchmarks.record.build_record`'s one shape (description, config, environment with
the git SHA, extra keys, results). Benchmarks whose committed records have a shape of their own
(`kernels`: a versioned schema compared against stored baselines; `pie`: per-sample records that
`--resume`/`--merge`/`--compare` read; `lmeval`: a folder of files) write it with `Run.write`,
atomically too. `--out` is relative to the working directory, never to the installed package.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from benchmarks.record import build_record
from lcx.kernels import gpu_slug  # noqa: F401  (re-exported: the bench modules' name for it)


class _Off:
    """The default of a common flag a benchmark does not take."""

    def __repr__(self) -> str:
        return "OFF"


OFF: Any = _Off()


def _threads(text: str) -> int | str:
    """`--threads` as lcx.threads parses it (a positive integer or `auto`)."""
    from lcx.threads import parse_threads

    try:
        return parse_threads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_dict(config: Any) -> dict[str, Any]:
    """A frozen config dataclass as the record's "config" (its `to_dict()` if it has one).

    A mapping is taken as it is: the config of a record assembled from stored records (`--merge`).
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not (dataclasses.is_dataclass(config) and not isinstance(config, type)):
        raise TypeError(f"a benchmark config is a frozen dataclass (or a stored record's dict), "
                        f"not {type(config).__name__}")
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else dataclasses.asdict(config)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """What every `lcx bench <name>` has: its name and description, its default `--out`, and which
    of the common flags it takes.

    out: the default result path (None: the benchmark computes it, e.g. per GPU; `out_help` says how).
    threads: `--threads N|auto` with this default (OFF: no flag; None: leave torch's setting).
    seed: `--seed` with this default (OFF: no flag).
    plot: whether a PNG is drawn beside the JSON (adds `--no-plot`).
    record_description: the record's "description" where it says more than the command's help.
    """

    name: str
    description: str
    doc: str | None = None
    out: str | None = None
    out_help: str | None = None
    threads: Any = OFF
    threads_help: str | None = None
    seed: Any = OFF
    plot: bool = False
    record_description: str | None = None  # the record's "description" (default: `description`)

    # ---------------------------------------------------------------- command line
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The common flags, and the module docstring after its first paragraph as the epilog."""
        if self.doc:
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
            parts = self.doc.strip().split("\n\n", 1)
            parser.epilog = parts[1] if len(parts) > 1 else None
        what = "result JSON" + (", PNG beside it" if self.plot else "")
        parser.add_argument("--out", type=Path, default=self.out,
                            help=self.out_help or f"{what}; relative to the working directory (default: %(default)s)")
        if self.threads is not OFF:
            from lcx.threads import add_threads_argument

            help_ = self.threads_help or (None if self.threads is not None else
                                          "torch CPU threads, N or auto (lcx.threads); default: torch's own")
            if help_ is None:
                add_threads_argument(parser, default=self.threads)  # lcx's help text, as every command
            else:
                parser.add_argument("--threads", type=_threads, default=self.threads, metavar="N|auto", help=help_)
        if self.seed is not OFF:
            parser.add_argument("--seed", type=int, default=self.seed, help="random seed (default: %(default)s)")
        if self.plot:
            parser.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG")

    def command(self, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int]) -> Callable[[list[str] | None], int]:
        """`main(argv)` of the module: `python -m benchmarks.<name>` parses as `lcx bench <name>`."""

        def main(argv: list[str] | None = None) -> int:
            parser = argparse.ArgumentParser(prog=f"lcx bench {self.name}", description=self.description)
            add_arguments(parser)
            return run(parser.parse_args(argv))

        main.__doc__ = f"`lcx bench {self.name}` with `argv` (default: sys.argv[1:])."
        return main

    # ---------------------------------------------------------------- one run
    def resolve_threads(self, args: argparse.Namespace, *, apply: bool = True) -> int | None:
        """`--threads` resolved (`auto` measured; lcx.threads) and, with `apply`, set in torch.
        None when the flag was left at None: torch's own setting stays."""
        value = getattr(args, "threads", None)
        if value is None:
            return None
        from lcx.threads import resolve_threads

        return resolve_threads(value, apply=apply)

    def start(self, args: argparse.Namespace, config: Any = None, *, out: str | Path | None = None,
              environment: dict[str, Any] | None = None) -> Run:
        """A run writing to `out` (default `--out`) with this resolved config (a frozen dataclass;
        None for a benchmark that writes a record of its own shape with `Run.write`); the clock starts."""
        path = out if out is not None else getattr(args, "out", None)
        return Run(self, None if path is None else Path(path), config, dict(environment or {}),
                   plot=self.plot and not getattr(args, "no_plot", False))


@dataclasses.dataclass
class Run:
    """One run of a benchmark: where it writes, its config, the clock, the record."""

    bench: Benchmark
    out: Path | None
    config: Any
    environment: dict[str, Any]  # facts only the benchmark knows (device, load average ...)
    plot: bool = False
    t0: float = dataclasses.field(default_factory=time.time)
    _env: dict[str, Any] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        # lcx's environment (the git SHA among it) as the run starts: the code it runs is the code
        # imported now, not what the checkout holds when the first result is saved
        from lcx.data.io import environment

        self._env = environment()

    def elapsed(self, digits: int | None = None) -> float:
        """Seconds since the run started (rounded to `digits` if given)."""
        s = time.time() - self.t0
        return s if digits is None else round(s, digits)

    @property
    def png(self) -> Path:
        """The plot's path: the JSON's, `.png` for `.json` (or `.json.gz`)."""
        from lcx.data.io import with_suffix

        assert self.out is not None, "this run writes no file"
        return with_suffix(self.out, ".png")

    def record(self, results: Any, **extra: Any) -> dict[str, Any]:
        """The record of this run as it stands (lcx's environment as the run started)."""
        return build_record(description=self.bench.record_description or self.bench.description,
                            config=config_dict(self.config), results=results,
                            environment={**self._env, **self.environment}, **extra)

    def save(self, results: Any, *, quiet: bool = True, **extra: Any) -> dict[str, Any]:
        """Write the record atomically (after every case: a cut-off run keeps what it measured)."""
        rec = self.record(results, **extra)
        self.write(rec, quiet=quiet)
        return rec

    def finish(self, results: Any, *, plot: Callable[[dict, Path], None] | None = None,
               **extra: Any) -> dict[str, Any]:
        """The final record, its path printed, then `plot(record, png)` beside it (unless --no-plot)."""
        rec = self.save(results, quiet=False, **extra)
        if plot is not None and self.plot:
            self.draw(plot, rec)
        return rec

    def draw(self, plot: Callable[[dict, Path], None], record: dict) -> Path:
        plot(record, self.png)
        print(f"wrote {self.png}")
        return self.png

    def write(self, obj: Any, path: str | Path | None = None, *, rows: tuple[str, ...] = (),
              quiet: bool = True) -> Path:
        """Any JSON (default: to `out`), atomically; gzipped for `.gz` (`lcx.data.io`)."""
        from lcx.data.io import atomic_write_json

        target = atomic_write_json(Path(path) if path is not None else self.out, obj, rows=rows)
        if not quiet:
            print(f"wrote {target}")
        return target

    def progress(self, items: Iterable[Any], *, desc: str | None = None, unit: str = "case",
                 total: int | None = None, enabled: bool = True) -> Iterable[Any]:
        """A progress bar on stderr over `items` (plain iteration without tqdm). Print inside the
        loop with `Run.log`, so the lines stay above the bar."""
        return progress(items, desc=desc or self.bench.name, unit=unit, total=total, enabled=enabled)

    @staticmethod
    def log(line: str) -> None:
        log(line)


def progress(items: Iterable[Any], *, desc: str, unit: str = "case", total: int | None = None,
             enabled: bool = True) -> Iterable[Any]:
    """tqdm over `items` on stderr, or `items` itself where tqdm is missing (a GPU machine with
    only torch and triton) or `enabled` is False."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, dynamic_ncols=True)


def log(line: str) -> None:
    """Print a line to stdout without breaking a progress bar (tqdm.write when tqdm is there)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(line, flush=True)
        return
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


@contextlib.contextmanager
def figure(path: str | Path, nrows: int = 1, ncols: int = 1, *, title: str | None = None,
           title_size: float | None = None, layout: str = "tight", dpi: int = 120,
           **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """`(fig, axes)` of `plt.subplots(nrows, ncols, **subplots)` (Agg backend); on leaving the block
    the figure gets `title`, its layout (`tight`, or `constrained` set at creation) and is written to
    `path` atomically (`lcx.data.io.atomic_savefig`), then closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lcx.data.io import atomic_savefig

    fig, axes = plt.subplots(nrows, ncols, constrained_layout=layout == "constrained", **subplots)
    try:
        yield fig, axes
        if title is not None:
            fig.suptitle(title, **({} if title_size is None else {"fontsize": title_size}))
        if layout == "tight":
            fig.tight_layout()
        atomic_savefig(fig, path, dpi=dpi)
    finally:
        plt.close(fig)


def replot(path: str | Path, plot: Callable[[dict, Path], None]) -> Path:
    """Redraw the PNG beside a stored record from the record alone (nothing measured)."""
    from lcx.data.io import json_path, read_json, with_suffix

    record = read_json(json_path(path))
    png = with_suffix(path, ".png")
    plot(record, png)
    print(f"wrote {png}")
    return png


# ----------------------------------------------------------------------------- GPU timing
# Shared by `lcx bench kernels` (one module per kernel, benchmarks/kernels/) and `lcx bench scale`:
# what a timed call is (`Prepared`), the timer (`time_case`: triton's do_bench on CUDA, wall clock on
# the CPU), the roofline ceilings measured in the same run, input buffers that defeat the L2 cache,
# and the GPU's name as a file name. torch is imported inside, so `lcx bench <name> --help` stays light.
@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a case's setup returns: a call over buffer `i`, and its roofline numbers."""

    run: Callable[[int], Any]  # run(i): one call on input set i % n_buffers
    n_buffers: int
    bytes: float  # minimum HBM traffic of one call
    flops: float  # useful FLOPs of one call (0 for pure data movement)
    shape: dict[str, Any] = dataclasses.field(default_factory=dict)


class Skip(Exception):
    """Raised by a case's setup when its implementation is unavailable or refuses the shape."""


def n_buffers(nbytes: float, device: str) -> int:
    """Input sets to rotate over so that together they exceed 4 x L2 (at most 16)."""
    if device != "cuda":
        return 1
    import math

    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    return int(min(16, max(1, math.ceil(4 * l2 / max(nbytes, 1)))))


def randn(shape, dtype, device, n, seed=0) -> list:
    """`n` standard-normal tensors of `shape` (drawn in float32, then cast), reproducible by `seed`."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(n)]


def need_cuda(device: str, what: str) -> None:
    if device != "cuda":
        raise Skip(f"{what} needs a CUDA GPU")


def need_triton(device: str) -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed")
    need_cuda(device, "triton")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
DO_BENCH_MIN_MS = 100.0  # do_bench's time budget at the least (its default `rep`)


def time_case(prep: Prepared, device: str, *, warmup: int, repeats: int,
              do_bench: Callable[..., Any] | None = None) -> list[float]:
    """Milliseconds of the timed calls, after `warmup` calls: on CUDA through
    `triton.testing.do_bench` (CUDA events per call, L2 flushed before each), on the CPU the wall clock of `repeats` calls.
    `do_bench` stands in for triton's (tests drive the CUDA path's logic on the CPU with it)."""
    for i in range(warmup):
        prep.run(i)
    _sync(device)
    if device == "cuda" or do_bench is not None:
        if do_bench is None:
            from triton.testing import do_bench  # triton comes with torch's CUDA builds
        return _time_do_bench(prep, do_bench, warmup=warmup, repeats=repeats)
    times = []
    for i in range(warmup, warmup + repeats):
        t0 = time.perf_counter()
        prep.run(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _time_do_bench(prep: Prepared, do_bench: Callable[..., Any], *, warmup: int, repeats: int) -> list[float]:
    """do_bench counts in milliseconds, this benchmark in calls: a probe (do_bench's one timed call)
    gives a call's time t, then the budget is max(100 ms, (repeats + 1) t), i.e. about `repeats`
    calls for slow kernels and more for fast ones. Each call takes the next input buffer."""
    calls = iter(range(warmup, 1 << 62))

    def fn() -> Any:
        return prep.run(next(calls))

    t = float(do_bench(fn, warmup=0, rep=0, return_mode="median"))
    times = do_bench(fn, warmup=0, rep=max(DO_BENCH_MIN_MS, (repeats + 1) * t), return_mode="all")
    return [float(x) for x in times]


def measure_ceilings(device: str, *, tiny: bool = False) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and bf16 matmul TFLOP/s, medians of 10."""
    import statistics

    import torch

    n = 2**20 if tiny else 2**28  # 1 GiB of float32 on the GPU
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = Prepared(lambda i: dst.copy_(src), 1, 2.0 * n * 4, 0.0)
    t_copy = statistics.median(time_case(copy, device, warmup=3, repeats=10))
    s = 256 if tiny else 8192
    mm_dt = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(s, s, device=device).to(mm_dt) for _ in range(2))
    mm = Prepared(lambda i: a @ b, 1, 0.0, 2.0 * s**3)
    t_mm = statistics.median(time_case(mm, device, warmup=3, repeats=10))
    return {"copy_GBps": round(copy.bytes / t_copy / 1e6, 1), "matmul_TFLOPs": round(mm.flops / t_mm / 1e9, 2),
            "matmul_dtype": str(mm_dt).removeprefix("torch.")}




def op_shares(prof: Any, top: int = 8) -> dict[str, Any]:
    """A finished torch.profiler run's operators by self CPU time: each of the `top` ones' share
    of the total and its call count (the profiler's overhead inflates the total; the shares are
    what it is for)."""
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    return {"self_cpu_share": {e.key: round(e.self_cpu_time_total / total, 4) for e in ops[:top]},
            "calls": {e.key: e.count for e in ops[:top]}}


def cpu_gemm_flops(threads: int, n: int = 2048, repeats: int = 3) -> float:
    """This process's float32 single-GEMM throughput (flop/s of CPU time) on `threads` threads:
    an n x n x n matmul, after one warm-up."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    a @ a
    c0 = time.process_time()
    for _ in range(repeats):
        a @ a
    return repeats * 2 * n**3 / (time.process_time() - c0)


def roofline(prep: Prepared, times: list[float], ceilings: dict[str, float]) -> dict[str, Any]:
    """A timed call's row: median/min/every time (ms), bytes and FLOPs, GB/s and TFLOP/s, and their
    percentage of the ceilings measured in the same run (`measure_ceilings`)."""
    import statistics

    med = statistics.median(times)
    row: dict[str, Any] = {
        "shape": prep.shape,
        "median_ms": round(med, 5), "min_ms": round(min(times), 5), "times_ms": [round(t, 5) for t in times],
        "n_buffers": prep.n_buffers, "bytes": prep.bytes, "flops": prep.flops,
        "GBps": round(prep.bytes / med / 1e6, 1), "TFLOPs": round(prep.flops / med / 1e9, 3),
    }
    row["pct_bandwidth"] = round(100 * row["GBps"] / ceilings["copy_GBps"], 1) if ceilings.get("copy_GBps") else None
    row["pct_matmul"] = round(100 * row["TFLOPs"] / ceilings["matmul_TFLOPs"], 1) if ceilings.get("matmul_TFLOPs") else None
    return row


def versions() -> dict[str, Any]:
    """`lcx.data.io.environment()` plus triton and CUDA versions; degrades to the essentials on
    a machine without transformers/tokenizers (GPU machines may have only torch + triton)."""
    import platform

    import torch

    from lcx.data.io import environment, git_info

    try:
        env = environment()
    except ImportError as e:
        env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
               "git": git_info(), "note": f"partial environment ({e})"}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        env["triton"] = f"unavailable ({type(e).__name__})"
    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env




__all__ = ["OFF", "Benchmark", "DO_BENCH_MIN_MS", "Prepared", "Run", "Skip", "config_dict", "figure", "gpu_slug",
           "log", "measure_ceilings", "n_buffers", "need_cuda", "need_triton", "progress", "randn", "replot",
           "roofline", "time_case", "versions"]
