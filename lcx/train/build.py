"""`lcx train build NAME`: build a bundled model that the repository keeps as a recipe, not as weights.

The tracked tree must fit a GPU call's payload with 8 MiB to spare (tests/test_packaging.py), so
of lcx's three trained models one ships its weights (tiny-ret-5m, the report's) and tiny-swat-5m
(#45) and tiny-5m (#74) ship their recipes: lcx/assets/<dir>/ holds a model's config, tokenizer, the `train_config.json` it was
trained with, and `weights.json`, the provenance of the weights every committed result used (their
sha256, and the commit and path where git still holds them). This command puts the model where
its preset finds it, `$LCX_CACHE_DIR/built/<name>/` (default ~/.cache/lcx), in one of two ways:

- restore (the default, in a git checkout that has the commit): the committed weights, read from
  git's history and checked against their sha256: bitwise the model the results were measured on,
  in seconds;
- retrain (`--retrain`, or where git or the commit is not there, e.g. an installed wheel): the
  same training as `lcx train lm` from the recipe's `train_config.json` (progress bar on stderr;
  ~45 min on one core, results/train_tiny_swat.json), then the weights cast to the committed dtype.
  A retrained model may differ bitwise from the committed one (another torch, CPU or thread count:
  training is bitwise reproducible only on the same ones); `build.json` in the entry says whether
  its sha256 equals the recorded one. `lcx report` fingerprints a model's files, so its cells
  measured on other weights are measured again, never mixed.

The entry is written to a temporary directory and renamed into place: it exists only complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

PROVENANCE = "weights.json"  # in a recipe directory: the committed weights' sha256 and where git holds them
RECIPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "train_config.json")
WEIGHTS = "model.safetensors"


def recipe_dir(name: str) -> Path:
    """lcx/assets/<asset dir> of the preset `name`, when it is kept as a recipe (has weights.json)."""
    for path in sorted(Path(str(resources.files("lcx") / "assets")).iterdir()):
        prov = path / PROVENANCE
        if prov.is_file() and json.loads(prov.read_text())["preset"] == name:
            return path
    raise ValueError(f"{name!r} is not a model lcx keeps as a recipe; buildable: {', '.join(recipes()) or 'none'}")


def recipes() -> list[str]:
    """The presets kept as recipes (lcx/assets/*/weights.json)."""
    root = Path(str(resources.files("lcx") / "assets"))
    return sorted(json.loads(p.read_text())["preset"] for p in root.glob(f"*/{PROVENANCE}"))


def _sha256(data_or_path: bytes | Path) -> str:
    h = hashlib.sha256()
    if isinstance(data_or_path, bytes):
        h.update(data_or_path)
    else:
        with open(data_or_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


FETCH_TIMEOUT_S = 300  # one commit fetched into a shallow clone (its tree: ~25 MB)


def _fetch_into_shallow_clone(top: str, commit: str) -> str:
    """Where `top` is a shallow clone, fetch `commit` alone (depth 1) from its `origin` so that its
    blobs are here; '' when fetched, else why not (not shallow, no origin, the fetch failed)."""
    run = dict(capture_output=True, text=True)
    if subprocess.run(["git", "-C", top, "rev-parse", "--is-shallow-repository"], **run).stdout.strip() != "true":
        return "not a shallow clone"
    try:
        r = subprocess.run(["git", "-C", top, "fetch", "--quiet", "--no-tags", "--depth=1", "origin", commit],
                           env={**os.environ, "GIT_TERMINAL_PROMPT": "0"}, timeout=FETCH_TIMEOUT_S, **run)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"fetching it from origin into this shallow clone failed: {e}"
    lines = r.stderr.strip().splitlines()
    return "" if r.returncode == 0 else (f"fetching it from origin into this shallow clone failed"
                                         f"{': ' + lines[-1] if lines else ''}")


def committed_weights(recipe: Path, prov: dict[str, Any]) -> tuple[bytes | None, str]:
    """The committed `model.safetensors` from git's history (checked against its sha256), or None
    and why not. In a shallow clone (CI's, `git clone --depth 1`) the one commit that holds them is
    fetched from `origin` first (depth 1, no prompt, `FETCH_TIMEOUT_S`)."""
    git = prov["git"]
    blob_cmd = ["cat-file", "blob", f"{git['commit']}:{git['path']}"]
    fetched = ""
    try:
        top = subprocess.run(["git", "-C", str(recipe), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        r = subprocess.run(["git", "-C", top, *blob_cmd], capture_output=True)
        if r.returncode != 0:
            why_not = _fetch_into_shallow_clone(top, git["commit"])
            fetched = " (fetched from origin into this shallow clone)" if not why_not else ""
            if why_not and why_not != "not a shallow clone":
                return None, f"git does not have {git['path']} at {git['commit'][:12]} here; {why_not}"
            r = subprocess.run(["git", "-C", top, *blob_cmd], capture_output=True, check=True)
        blob = r.stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", None) or b""  # (text from rev-parse, bytes from cat-file)
        detail = (err.decode(errors="replace") if isinstance(err, bytes) else err).strip().splitlines()
        return None, (f"git does not have {git['path']} at {git['commit'][:12]} here"
                      f"{' (' + detail[-1] + ')' if detail else ''}")
    data = lzma.decompress(blob) if git["path"].endswith(".xz") else blob
    want = prov[WEIGHTS]["sha256"]
    if _sha256(data) != want:
        return None, f"the weights in git at {git['commit'][:12]} do not have the recorded sha256 {want[:12]}"
    return data, f"restored from git ({git['commit'][:12]}:{git['path']}){fetched}, sha256 {want[:12]} checked"


def retrain(recipe: Path, out: Path, *, threads: int | str = 1, progress: bool = True,
            overrides: dict[str, Any] | None = None) -> Path:
    """Train the recipe's `train_config.json` as `lcx train lm` does, into `out` (float32 weights,
    its training log). `overrides`: TrainConfig fields replaced (tests run a few steps)."""
    import dataclasses

    from transformers import AutoTokenizer

    from lcx.data import encode_documents
    from lcx.data.io import environment
    from lcx.allocator import reuse_freed_memory
    from lcx.threads import resolve_threads

    from .lm import CORPORA, TrainConfig, train

    resolve_threads(threads)
    reuse_freed_memory()
    cfg = TrainConfig.from_dict(json.loads((recipe / "train_config.json").read_text())["train_config"])
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(recipe, local_files_only=True)
    train_docs, val_docs = CORPORA[cfg.corpus]("train"), CORPORA[cfg.corpus]("held_out")
    train_ids = encode_documents(tokenizer, [d.text for d in train_docs])
    val_ids = encode_documents(tokenizer, [d.text for d in val_docs])
    env = environment()
    train(cfg, out, tokenizer=tokenizer, train_ids=train_ids, val_ids=val_ids, plot=False, progress=progress,
          extra_log={"git": env.pop("git"), "environment": env, "tokenizer": {"source": f"recipe {recipe.name}"},
                     "held_out": [d.name for d in val_docs]})
    return out


def build(name: str, *, retrain_model: bool = False, threads: int | str = 1, progress: bool = True,
          overrides: dict[str, Any] | None = None, force: bool = False, restore_only: bool = False) -> Path:
    """Build the preset `name` into `$LCX_CACHE_DIR/built/<name>/` (module docstring); returns it.
    `restore_only`: a ValueError saying why instead of retraining where git does not hold the
    committed weights (what scripts/setup.sh asks: seconds or nothing, never 45 minutes)."""
    from lcx.models.cli import export_model
    from lcx.models.loading import built_dir

    recipe = recipe_dir(name)
    prov = json.loads((recipe / PROVENANCE).read_text())
    entry = built_dir(name)
    if entry.exists() and not force:
        raise ValueError(f"{entry} exists (built before): pass --force to build it again")
    entry.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=entry.parent, prefix=f".{name}-build-") as tmp:
        tmp = Path(tmp)
        staged = tmp / "entry"
        staged.mkdir()
        data, how = (None, "--retrain") if retrain_model or overrides else committed_weights(recipe, prov)
        if data is None and restore_only:
            raise ValueError(f"{name}: not restored ({how}); `lcx train build {name}` retrains it (~45 min on one core)")
        if data is not None:
            (staged / WEIGHTS).write_bytes(data)
            record = {"how": "restored", "detail": how}
        else:
            print(f"{name}: retraining from {recipe / 'train_config.json'} ({how})", flush=True)
            trained = retrain(recipe, tmp / "trained", threads=threads, progress=progress, overrides=overrides)
            # the committed weights went the same way: `lcx models --export DIR --dtype bfloat16`
            export_model(str(trained), str(staged), prov[WEIGHTS]["dtype"])
            shutil.copy2(trained / "train_log.json", staged / "build_train_log.json")
            record = {"how": "retrained", "detail": f"lcx.train.build.retrain, threads={threads}"
                      + (f", overrides={overrides}" if overrides else "")}
        for f in RECIPE_FILES:  # the recipe's own files (its config records the method and dtype)
            shutil.copyfile(recipe / f, staged / f)
        sha = _sha256(staged / WEIGHTS)
        record.update(preset=name, sha256=sha, recorded_sha256=prov[WEIGHTS]["sha256"],
                      identical_to_committed=sha == prov[WEIGHTS]["sha256"], seconds=round(time.perf_counter() - t0, 1))
        (staged / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(staged, entry)
    same = "bitwise the committed weights" if record["identical_to_committed"] else (
        f"NOT bitwise the committed weights (sha256 {sha[:12]} vs {prov[WEIGHTS]['sha256'][:12]}): results "
        "measured on this build are its own")
    print(f"{name}: {record['how']} in {record['seconds']:.0f} s into {entry}; {same}")
    return entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lcx.threads import add_threads_argument

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("name", help=f"the model preset to build ({', '.join(recipes()) or 'none'})")
    parser.add_argument("--retrain", action="store_true",
                        help="train it again from its train_config.json even where git holds the committed weights")
    parser.add_argument("--force", action="store_true", help="replace an existing build")
    parser.add_argument("--restore-only", action="store_true",
                        help="restore the committed weights from git or fail (exit 2) saying why; never retrain")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while retraining")
    add_threads_argument(parser, default=1)


def run(args: argparse.Namespace) -> int:
    if args.retrain and args.restore_only:
        print("lcx train build: --retrain and --restore-only exclude each other", file=sys.stderr)
        return 2
    try:
        build(args.name, retrain_model=args.retrain, threads=args.threads, progress=not args.no_progress,
              force=args.force, restore_only=args.restore_only)
    except ValueError as e:
        print(f"lcx train build: {e}", file=sys.stderr)
        return 2
    return 0
