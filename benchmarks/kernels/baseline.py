"""The stored result of `lcx bench kernels` (`results/kernels/<gpu>.json`, schema `SCHEMA`) and
the regression check against it: `validate` names the first bad field, `compare` (a pure
function) flags a kernel more than `threshold` (10%) slower in median than in the baseline of the
SAME GPU, and a baseline kernel the new run no longer has; runs on different GPUs are refused."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA = "lcx.bench.kernels/1"  # the committed baselines' schema (named before the move to benchmarks/)
THRESHOLD = 0.10


def validate(result: dict) -> None:
    """Raise ValueError naming the first field a result JSON lacks or has wrong."""
    for key, typ in (("schema", str), ("gpu", str), ("device", str), ("smoke", bool), ("kernels", dict),
                     ("environment", dict), ("ceilings", dict), ("config", dict)):
        if not isinstance(result.get(key), typ):
            raise ValueError(f"kernel benchmark result: {key!r} missing or not {typ.__name__}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"kernel benchmark result: schema {result['schema']!r}, expected {SCHEMA!r}")
    for name, row in result["kernels"].items():
        if "skipped" in row:
            continue
        for key in ("median_ms", "bytes", "flops", "GBps", "TFLOPs", "times_ms"):
            if key not in row:
                raise ValueError(f"kernel benchmark result: kernel {name!r} lacks {key!r}")
        if not (isinstance(row["median_ms"], (int, float)) and row["median_ms"] > 0):
            raise ValueError(f"kernel benchmark result: kernel {name!r} has median_ms={row['median_ms']!r}")


@dataclass(frozen=True)
class Comparison:
    regressions: list[tuple[str, float, float]]  # (kernel, baseline ms, new ms)
    missing: list[str]  # timed in the baseline, absent or skipped now
    new: list[str]  # timed now, not in the baseline
    compared: int

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.missing

    def report(self, threshold: float = THRESHOLD) -> str:
        lines = [f"compared {self.compared} kernels against the baseline (fail: > {threshold:.0%} slower)"]
        lines += [f"REGRESSION {k}: {b:.4g} ms -> {n:.4g} ms (+{100 * (n / b - 1):.1f}%)" for k, b, n in self.regressions]
        lines += [f"MISSING {k}: timed in the baseline, not in this run" for k in self.missing]
        lines += [f"new {k} (no baseline)" for k in self.new]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def compare(new: dict, baseline: dict, threshold: float = THRESHOLD) -> Comparison:
    """Kernels more than `threshold` slower (median) than in `baseline`, and those gone missing.

    Refuses (ValueError) runs of different GPUs and CPU smoke runs.
    """
    validate(new)
    validate(baseline)
    for which, r in (("new run", new), ("baseline", baseline)):
        if r["smoke"]:
            raise ValueError(f"the {which} is a CPU smoke run, not a measurement to compare")
    if new["gpu"] != baseline["gpu"]:
        raise ValueError(f"baseline is from {baseline['gpu']!r}, this run from {new['gpu']!r}: "
                         "compare only runs of the same GPU")
    timed = lambda r: {k: v["median_ms"] for k, v in r["kernels"].items() if "median_ms" in v}  # noqa: E731
    tn, tb = timed(new), timed(baseline)
    regressions = [(k, tb[k], tn[k]) for k in sorted(tb) if k in tn and tn[k] > tb[k] * (1 + threshold)]
    missing = sorted(k for k in tb if k not in tn)
    return Comparison(regressions, missing, sorted(k for k in tn if k not in tb), len(set(tn) & set(tb)))
