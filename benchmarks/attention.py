"""`lcx bench attention`: Λ-mask / LM-Infinite per lcx.attention backend vs dense causal SDPA, CPU.

    lcx bench attention                      # 2k, 8k, 32k -> results/attention_cpu.{json,png}
    lcx bench attention --lengths 2048 --repeats 2 --out /tmp/a.json
    lcx bench attention --replot             # only redraw the PNG from --out

Shapes: batch 1, 8 heads (8 kv heads), head dim 64, float32, prefill (Tq = Tk = T).
Cases, all in one run (ratios are against the baseline of the same run):
  dense_sdpa            baseline: F.scaled_dot_product_attention(q, k, v, is_causal=True) on
                        pre-rotated q/k (torch's CPU flash kernel: O(T) memory, O(T^2) work).
  lambda/<backend>      the Λ-mask alone, lambda_mask(G, L), on pre-rotated q/k.
  lm_infinite/<backend> LM-Infinite, AttentionSpec.lm_infinite(G, L): unrotated q/k + Rotary, so
                        its time includes RoPE (float64 tables) and the capped global branch.
with G = 64 global and L = 1024 local keys (the setting of the Λ speed goal) and backends ref, sdpa,
blockwise, flex, flex_compiled and flash (torch's fused CPU flash kernel: the window as one
batched call over strided key chunks, the global keys as a second call, merged by
log-sum-exp; see lcx/attention/flash_backend.py). One thread by default: on a shared, oversubscribed machine two OpenMP threads
per process turn every small op into a synchronisation stall.

Every case runs in its own subprocess. Time, `median_s`: median CPU time of the process
(`time.process_time`, all threads) per call over repeated calls after one warm-up call (the
warm-up, which includes torch.compile for flex_compiled, is `first_call_s`, wall). CPU time,
not wall time, because the machine is shared and oversubscribed: wall time then measures the
neighbours (the wall medians, `median_wall_s`, are recorded too). With one thread, CPU time
is the work the call did. Memory, `peak_mb`: the increase of the process's peak resident set during ONE
call over its resident set just before it. Linux's high-water mark is reset right before the
call (`/proc/self/clear_refs` 5) and read after it (VmHWM); glibc's mmap threshold is fixed at
64 KiB (MALLOC_MMAP_THRESHOLD_) so every tensor above that is its own mapping, returned to
the OS when freed, so the figure is what the call really touched (live tensors, temporaries
and allocator overhead, at page granularity), not memory cached from earlier calls.
`--interleave ROUNDS` (the ≥ 10× record, results/attention_flash_32k_cpu.json):

    lcx bench attention --lengths 32768 --cases dense_sdpa lambda/flash lm_infinite/flash --interleave 5 \
        --out results/attention_flash_32k_cpu.json

runs every case in this one process instead, ROUNDS rounds per length, each round every case
once (order reversed on odd rounds), so a change of the shared machine's load hits all cases
alike; per case the CPU times, their median, and `paired_speedup`: the median over rounds of
dense_sdpa's time over the case's in the same round (the 1-minute load average after each
round is recorded). No memory figures in this mode. The record adds `ceiling` per length (the
FLOPs of dense causal attention, of the Λ-mask and of what the flash backend computes, this
process's float32 GEMM rate, the FLOP ratios, each side's achieved GFLOP/s) and `profile`
(torch.profiler: each op's share of one call's self CPU time, per Λ case).

Guards: a case whose projection from its previous length (x (T/T_prev)^2, conservative for
linear cases) exceeds --mem-limit-gb or --time-limit-s is skipped, with the projection
recorded. Timings on a shared 2-core machine are noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import Benchmark, cpu_gemm_flops, figure, op_shares, replot

DESCRIPTION = "CPU attention time and peak memory: Λ-mask / LM-Infinite per lcx.attention backend vs dense causal SDPA"
BENCH = Benchmark("attention", DESCRIPTION, __doc__, out="results/attention_cpu.json", threads=1, plot=True,
                  threads_help="torch threads of each case's process (default: %(default)s)")
BACKENDS = ("ref", "sdpa", "blockwise", "flex", "flex_compiled", "flash")
H, D, B = 8, 64, 1


@dataclass(frozen=True, kw_only=True)
class Config:
    batch: int = B
    heads: int = H
    kv_heads: int = H
    head_dim: int = D
    dtype: str = "float32"
    n_global: int
    n_local: int
    lengths: list[int]
    repeats: int
    budget_s: float
    threads: int
    mem_limit_gb: float
    time_limit_s: float
    cases: list[str]
    interleave: int = 0  # rounds in one process; 0: one subprocess per case
    memory_measure: str = ("peak RSS increase during one call (VmHWM after reset via /proc/self/clear_refs minus "
                           "VmRSS before; MALLOC_MMAP_THRESHOLD_=65536), one subprocess per case")
    time_measure: str = ("median process CPU time (time.process_time) over repeats after one warm-up call; "
                         "median wall time recorded as median_wall_s")


def cases() -> list[str]:
    return ["dense_sdpa"] + [f"{kind}/{b}" for kind in ("lambda", "lm_infinite") for b in BACKENDS]


# ------------------------------------------------------------------------------ child


def make_call(case: str, T: int, G: int, L: int):
    """The case's inputs (seeded) and a no-argument call that runs it once."""
    import torch
    import torch.nn.functional as F

    from lcx.attention import AttentionSpec, Rotary, attention
    from lcx.masks import lambda_mask
    from lcx.rope import RopeSpec, compute_inv_freq

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, D, generator=g)
    if case == "dense_sdpa":
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D]
        del q, k, v
        return lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    kind, backend = case.split("/")
    if kind == "lambda":
        spec, rotary = AttentionSpec(mask=lambda_mask(G, L)), None
    else:
        spec = AttentionSpec.lm_infinite(G, L)
        inv_freq, af = compute_inv_freq(RopeSpec.from_dict({"rope_type": "default", "rope_theta": 10000.0}), D)
        rotary = Rotary(inv_freq, None, af)
    return lambda: attention(q, k, v, spec, backend=backend, rotary=rotary)


def _timed(call):
    w0, c0 = time.perf_counter(), time.process_time()
    out = call()
    return out, time.perf_counter() - w0, time.process_time() - c0


def child(case: str, T: int, G: int, L: int, repeats: int, budget_s: float, threads: int) -> dict:
    import torch

    from benchmarks.measure import reset_peak, status_bytes

    torch.set_num_threads(threads)
    call = make_call(case, T, G, L)
    with torch.inference_mode():
        out, first, _ = _timed(call)
        del out
        before = status_bytes("VmRSS")
        reset_peak()
        out, w, c = _timed(call)
        peak = status_bytes("VmHWM") - before
        del out
        walls, cpus = [w], [c]
        start = time.perf_counter()
        while len(walls) < repeats and time.perf_counter() - start + walls[-1] < budget_s:
            out, w, c = _timed(call)
            walls.append(w)
            cpus.append(c)
            del out
    return {"first_call_s": first, "wall_s_list": walls, "cpu_s_list": cpus,
            "median_wall_s": statistics.median(walls), "median_s": statistics.median(cpus),
            "peak_mb": peak / 2**20, "threads": torch.get_num_threads()}


def interleaved(todo: list[str], T: int, G: int, L: int, rounds: int, threads: int) -> dict[str, dict]:
    """All cases in THIS process, timed in rounds: round r runs every case once, in order on even
    rounds and reversed on odd ones, so a change of the machine's load hits every case alike.
    Per case: the CPU / wall time lists, their medians, and (for every case but the baseline)
    `paired_speedup_list`, dense_sdpa's time over the case's in the same round, and its median.
    Peak memory is not measured here (the subprocess mode does that)."""
    import torch

    torch.set_num_threads(threads)
    calls = {c: make_call(c, T, G, L) for c in todo}
    res = {c: {"wall_s_list": [], "cpu_s_list": [], "threads": threads, "peak_mb": None} for c in todo}
    load = [os.getloadavg()[0]]
    with torch.inference_mode():
        for c in todo:  # warm-up
            out, first, _ = _timed(calls[c])
            res[c]["first_call_s"] = first
            del out
        for r in range(rounds):
            for c in todo if r % 2 == 0 else todo[::-1]:
                out, w, cpu = _timed(calls[c])
                del out
                res[c]["wall_s_list"].append(w)
                res[c]["cpu_s_list"].append(cpu)
            load.append(os.getloadavg()[0])
    for c, r in res.items():
        r.update(median_wall_s=statistics.median(r["wall_s_list"]), median_s=statistics.median(r["cpu_s_list"]),
                 status="ok", loadavg_1min=load)
        if "dense_sdpa" in res and c != "dense_sdpa":
            r["paired_speedup_list"] = [d / x for d, x in zip(res["dense_sdpa"]["cpu_s_list"], r["cpu_s_list"])]
            r["paired_speedup"] = statistics.median(r["paired_speedup_list"])
    return res


def profile_case(case: str, T: int, G: int, L: int, threads: int, top: int = 8) -> dict:
    """One call of the case under torch.profiler: each op's share of the self CPU time (the
    profiler's overhead inflates the total; the shares are what it is for)."""
    import torch
    from torch.profiler import profile

    torch.set_num_threads(threads)
    call = make_call(case, T, G, L)
    with torch.inference_mode():
        call()
        with profile() as prof:
            call()
    return op_shares(prof, top)


def ceiling(T: int, G: int, L: int, dense_s: float, lambda_s: float | None, threads: int) -> dict:
    """What the Λ-mask could reach against dense causal attention on this CPU: FLOPs of each
    (QK^T and PV, 2 flops per multiply-add), this process's single-GEMM throughput (2048^3
    float32 matmul), and the ratios those imply. `flop_ratio` = dense FLOPs / the mask's
    FLOPs: the speedup if both ran at the same rate; `decomposition_flop_ratio` counts what
    the flash backend computes (its query chunks read (r+1) C window keys, C - 1 more than W)."""
    import torch

    from lcx.attention.flash_backend import chunk_size

    torch.set_num_threads(threads)
    per_key = 4 * B * H * D  # flops per (query, key) pair
    dense = per_key * T * (T + 1) / 2
    i = torch.arange(T, dtype=torch.float64)
    nnz = float((torch.clamp(i + 1, max=L) + torch.clamp(i - L + 1, min=0, max=G)).sum())
    C = chunk_size(L)
    r = -(-L // C)
    b0 = min(T, r * C)
    computed = per_key * ((T - b0) * ((r + 1) * C + G) + b0 * (b0 + 1) / 2)
    gemm = cpu_gemm_flops(threads)
    out = {"dense_gflop": dense / 1e9, "lambda_mask_gflop": nnz * per_key / 1e9,
           "lambda_flash_computed_gflop": computed / 1e9, "chunk": C,
           "flop_ratio": dense / (nnz * per_key), "decomposition_flop_ratio": dense / computed,
           "gemm_gflops": gemm / 1e9, "dense_gflops": dense / dense_s / 1e9,
           "ratio_at_gemm_peak_for_lambda": dense_s / (computed / gemm)}
    if lambda_s:
        out["lambda_flash_gflops"] = computed / lambda_s / 1e9
    return out


# ------------------------------------------------------------------------------ parent


def run_case(case: str, T: int, args, threads: int) -> dict:
    """One case in a fresh interpreter (`python -m benchmarks.attention --child ...`, same
    working directory and PYTHONPATH, so the same lcx, with this checkout's root in front so that
    `benchmarks` is found from any directory), its memory measured in isolation."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "benchmarks.attention", "--child", case, "--child-length", str(T),
           "--global", str(args.n_global), "--local", str(args.n_local), "--repeats", str(args.repeats),
           "--budget-s", str(args.budget_s), "--threads", str(threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout_s)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"status": "error", "returncode": p.returncode, "error": " | ".join(tail), "wall_s": wall}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res.update(status="ok", wall_s=wall)
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    BENCH.add_arguments(ap)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--global", dest="n_global", type=int, default=64)
    ap.add_argument("--local", dest="n_local", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=60.0, help="time budget for repeats per case")
    ap.add_argument("--mem-limit-gb", type=float, default=4.0)
    ap.add_argument("--time-limit-s", type=float, default=240.0, help="skip a case projected slower per call")
    ap.add_argument("--case-timeout-s", type=float, default=1200.0)
    ap.add_argument("--cases", nargs="+", default=None, help=f"subset of {cases()}")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="time every case in this one process, ROUNDS interleaved rounds per length (the "
                         "cases alternate, so load changes hit all alike; adds per-round paired ratios, the "
                         "FLOP ceiling and a profile of the Λ cases; no memory figures). Default 0: one "
                         "subprocess per case")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from --out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-length", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:
        res = child(args.child, args.child_length, args.n_global, args.n_local, args.repeats, args.budget_s,
                    args.threads)
        print(json.dumps(res))
        return 0

    if args.replot:
        replot(args.out, plot)
        return 0
    unknown = sorted(set(args.cases or []) - set(cases()))
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; known: {cases()}")
    todo = args.cases or cases()
    threads = BENCH.resolve_threads(args, apply=False)  # each case's process sets it
    config = Config(n_global=args.n_global, n_local=args.n_local, lengths=sorted(args.lengths), repeats=args.repeats,
                    budget_s=args.budget_s, threads=threads, mem_limit_gb=args.mem_limit_gb,
                    time_limit_s=args.time_limit_s, cases=todo, interleave=args.interleave)
    if args.interleave:
        config = dataclasses.replace(
            config, memory_measure="not measured (--interleave: all cases in one process)",
            time_measure=f"process CPU time per call in {args.interleave} interleaved rounds after one warm-up "
                         "call per case, one process; median_s = median over rounds, paired_speedup = median over "
                         "rounds of dense_sdpa's time / the case's in the same round")
    rec = BENCH.start(args, config)
    if args.interleave:
        return run_interleaved(args, rec, todo, threads)
    results: dict[str, dict[str, dict]] = {c: {} for c in todo}
    last_ok: dict[str, tuple[int, dict]] = {}

    def save(quiet: bool = True) -> dict:
        return rec.save(results, quiet=quiet, wall_s=rec.elapsed(), summary=summarise(results, todo))

    for T, c in rec.progress([(T, c) for T in sorted(args.lengths) for c in todo]):
        prev = last_ok.get(c)
        if prev is not None:
            T0, r0 = prev
            f = (T / T0) ** 2
            mem, sec = r0["peak_mb"] * f / 1024, r0["median_s"] * f
            if mem > args.mem_limit_gb or sec > args.time_limit_s:
                results[c][str(T)] = {"status": "skipped", "reason": f"projected from T={T0} (x(T/T0)^2): "
                                      f"{mem:.1f} GB, {sec:.0f} s per call; limits {args.mem_limit_gb} GB, "
                                      f"{args.time_limit_s} s"}
                rec.log(f"T={T:>6} {c:<26} skipped ({results[c][str(T)]['reason']})")
                continue
        elif any(results[c].get(str(t), {}).get("status") in ("skipped", "error") for t in args.lengths if t < T):
            results[c][str(T)] = {"status": "skipped", "reason": "failed or skipped at a shorter length"}
            continue
        r = run_case(c, T, args, threads)
        results[c][str(T)] = r
        if r["status"] == "ok":
            last_ok[c] = (T, r)
            rec.log(f"T={T:>6} {c:<26} {r['median_s'] * 1e3:>10.1f} ms  peak {r['peak_mb']:>8.1f} MB  "
                    f"(first call {r['first_call_s']:.1f} s, {len(r['cpu_s_list'])} reps)")
        else:
            rec.log(f"T={T:>6} {c:<26} ERROR {r['error']}")
        save()
    print_table(results, todo, sorted(args.lengths))
    rec.finish(results, plot=plot, wall_s=rec.elapsed(), summary=summarise(results, todo))
    return 0


def run_interleaved(args, rec, todo: list[str], threads: int) -> int:
    results: dict[str, dict[str, dict]] = {c: {} for c in todo}
    extra: dict[str, dict] = {"ceiling": {}, "profile": {}}
    for T in sorted(args.lengths):
        rec.log(f"T={T}: {args.interleave} interleaved rounds of {todo} (load {os.getloadavg()[0]:.1f})")
        for c, r in interleaved(todo, T, args.n_global, args.n_local, args.interleave, threads).items():
            results[c][str(T)] = r
            rec.log(f"T={T:>6} {c:<26} {r['median_s'] * 1e3:>10.1f} ms"
                    + (f"  paired x{r['paired_speedup']:.2f}" if "paired_speedup" in r else ""))
        lam = [c for c in todo if c.startswith("lambda/")]
        if "dense_sdpa" in todo:
            lam_s = results[lam[0]][str(T)]["median_s"] if lam else None
            extra["ceiling"][str(T)] = ceiling(T, args.n_global, args.n_local,
                                               results["dense_sdpa"][str(T)]["median_s"], lam_s, threads)
        extra["profile"][str(T)] = {c: profile_case(c, T, args.n_global, args.n_local, threads)
                                    for c in todo if c != "dense_sdpa"}
        rec.save(results, wall_s=rec.elapsed(), summary=summarise(results, todo), **extra)
    print_table(results, todo, sorted(args.lengths))
    rec.finish(results, plot=plot, wall_s=rec.elapsed(), summary=summarise(results, todo), **extra)
    return 0


def summarise(results: dict, todo: list[str]) -> dict:
    """Per length: speedup (baseline time / case time) and memory of every ok case."""
    summary: dict[str, dict] = {}
    base = results.get("dense_sdpa", {})
    lengths = sorted({int(t) for r in results.values() for t in r})
    for T in lengths:
        b = base.get(str(T), {})
        row = {}
        for c in todo:
            r = results[c].get(str(T), {})
            if r.get("status") != "ok":
                continue
            row[c] = {"ms": r["median_s"] * 1e3, "peak_mb": r["peak_mb"]}
            if b.get("status") == "ok":
                row[c]["speedup_vs_dense_sdpa"] = b["median_s"] / r["median_s"]
                if "paired_speedup" in r:
                    row[c]["paired_speedup_vs_dense_sdpa"] = r["paired_speedup"]
                if r["peak_mb"] is not None and b["peak_mb"] is not None:
                    row[c]["memory_ratio_vs_dense_sdpa"] = r["peak_mb"] / b["peak_mb"] if b["peak_mb"] > 0 else None
        summary[str(T)] = row
    return summary


def print_table(results: dict, todo: list[str], lengths: list[int]) -> None:
    head = f"{'case':<26}" + "".join(f"{f'T={T} ms':>13}{'x sdpa':>8}{'MB':>9}" for T in lengths)
    print(head)
    print("-" * len(head))
    for c in todo:
        cells = ""
        for T in lengths:
            r, b = results[c].get(str(T), {}), results.get("dense_sdpa", {}).get(str(T), {})
            if r.get("status") != "ok":
                cells += f"{r.get('status', '-'):>13}{'':>8}{'':>9}"
                continue
            sp = b["median_s"] / r["median_s"] if b.get("status") == "ok" else float("nan")
            mb = f"{r['peak_mb']:>9.1f}" if r["peak_mb"] is not None else f"{'-':>9}"
            cells += f"{r['median_s'] * 1e3:>13.1f}{sp:>8.2f}{mb}"
        print(f"{c:<26}" + cells)


def plot(record: dict, path: Path) -> None:
    """CPU time and peak memory per call vs length, one line per case."""
    results, todo, lengths = record["results"], record["config"]["cases"], record["config"]["lengths"]
    colors = {b: f"C{i + 1}" for i, b in enumerate(BACKENDS)}
    title = ("CPU attention, 1 thread: Λ-mask (solid) and LM-Infinite (dashed), G=64, L=1024, per backend "
             "vs dense causal SDPA (black)")
    with figure(path, 1, 2, figsize=(12, 4.8), title=title) as (fig, axes):
        for c in todo:
            pts = [(T, results[c][str(T)]) for T in lengths if results[c].get(str(T), {}).get("status") == "ok"]
            if not pts:
                continue
            kind, _, backend = c.partition("/")
            style = dict(marker="o", color=colors.get(backend, "C0"), ls="--" if kind == "lm_infinite" else "-",
                         lw=2.5 if c == "dense_sdpa" or backend in ("blockwise", "flash") else 1.2)
            if c == "dense_sdpa":
                style.update(color="black")
            axes[0].plot([t for t, _ in pts], [r["median_s"] * 1e3 for _, r in pts], label=c, **style)
            mem = [(t, r["peak_mb"]) for t, r in pts if r["peak_mb"] is not None]
            if mem:
                axes[1].plot([t for t, _ in mem], [max(m, 0.1) for _, m in mem], label=c, **style)
        for ax, yl in zip(axes, ("CPU time per call (ms, median)", "peak memory of one call (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens (prefill, B=1, 8 heads, D=64, fp32)")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)


main = BENCH.command(add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
