"""`lcx models`: list the model presets, or load one model and summarise it.

    lcx models                       # presets, their files, presence and GGUF cache status
    lcx models --load smollm2-135m   # load (building the GGUF cache if needed) and summarise
    lcx models --load path/to/dir --dtype bfloat16
    lcx models --load HuggingFaceTB/SmolLM2-135M@main   # a Hub id, from the Hugging Face cache
    lcx models --export runs/my-model --out lcx/assets/my-model --dtype bfloat16 --xz
                                     # copy an HF directory with its weights stored in bfloat16,
                                     # xz-compressed (a third of float32's bytes; how the bundled
                                     # models are stored; `lcx.load_model` loads float32 by default)
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", metavar="NAME_OR_PATH",
                        help="load this preset, HF directory, .gguf file or Hub id (org/name[@revision]"
                             "[:file.gguf], through the Hugging Face cache) and print a summary")
    parser.add_argument("--dtype", default="float32",
                        help="parameter dtype for --load (float32, bfloat16, float16)")
    parser.add_argument("--device", default="cpu", help="device for --load (cpu, cuda, ...)")
    parser.add_argument("--export", metavar="HF_DIR",
                        help="write this HF model directory to --out with its weights cast to --dtype (its "
                             "tokenizer and train_config.json copied unchanged)")
    parser.add_argument("--out", help="output directory of --export")
    parser.add_argument("--xz", action="store_true",
                        help="--export: store the weights as model.safetensors.xz (lcx.load_model unpacks "
                             "them once into its cache)")


def run(args: argparse.Namespace) -> int:
    if args.export:
        if not args.out:
            raise ValueError("--export needs --out")
        export_model(args.export, args.out, args.dtype, compress=args.xz)
        print(f"exported {args.export} -> {args.out} ({args.dtype}{', xz' if args.xz else ''})")
        return 0
    if args.load:
        return _load(args.load, args.dtype, args.device)
    return _list()


def _list() -> int:
    from .loading import MODELS, cache_root, gguf_cache_dir, is_gguf_cached

    for p in MODELS.values():
        path = p.path()
        present = p.is_present()
        print(f"{p.name}  [{p.format}]  {'present' if present else 'MISSING'}")
        print(f"  {p.description}")
        if p.license:
            print(f"  license: {p.license}")
        print(f"  source: {path if path is not None else '(unknown)'}")
        if not present:
            print(f"  to get it: {p.how_to_get}")
        elif p.format == "gguf" and not path.is_file():  # shipped in parts (ModelPreset.assemble)
            print("  cache:  not built yet: the first load joins the installed parts into the source "
                  "above, then dequantizes it (a minute or two)")
        elif p.format == "gguf":
            cached = is_gguf_cached(path)
            state = "cached" if cached else "not cached yet: the first load dequantizes it (once)"
            print(f"  cache:  {gguf_cache_dir(path)} ({state})")
        print()
    print(f"cache root: {cache_root()} (set LCX_CACHE_DIR to move it)")
    from .hub import hub_cache_dir, hub_offline

    print(f"Hub ids (org/name[@revision][:file.gguf]) load through the Hugging Face cache {hub_cache_dir()} "
          f"({'HF_HUB_OFFLINE=1: cached models only' if hub_offline() else 'downloaded when missing'}; docs/models.md)")
    return 0


def summarize(model: Any) -> dict[str, Any]:
    """Architecture facts of a loaded HF causal LM, as a flat dict (used by `--load`)."""
    from lcx.hf.models import model_shape

    c = model.config
    shape = model_shape(c)
    rope = getattr(c, "rope_parameters", None) or {
        "rope_theta": getattr(c, "rope_theta", None), **(getattr(c, "rope_scaling", None) or {})}
    return {
        "model_type": c.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": dict(rope),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
    }


def export_model(src: str, out: str, dtype: str = "float16", *, compress: bool = False) -> None:
    """Copy the HF model directory `src` to `out` with weights cast to `dtype`: config, weights
    (safetensors; `model.safetensors.xz` with `compress`), its tokenizer and `train_config.json`
    (the training record) if present; each file moved into `out` atomically
    (`lcx.data.io.atomic_write_files`). `src` may itself be compressed."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lcx.data.io import atomic_write_files
    from lcx.hf.swat import from_pretrained_kwargs

    from .loading import as_dtype, compress_file, unpacked_dir

    if not (Path(src) / "config.json").is_file():
        raise FileNotFoundError(f"--export: {src} is not an HF model directory (no config.json)")
    src_p = unpacked_dir(Path(src))
    model = AutoModelForCausalLM.from_pretrained(src_p, dtype=as_dtype(dtype), local_files_only=True,
                                                 **from_pretrained_kwargs(src_p))
    tokenizer = AutoTokenizer.from_pretrained(src_p, local_files_only=True)

    def write(tmp: str) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (src_p / "train_config.json").is_file():
            shutil.copy2(src_p / "train_config.json", Path(tmp) / "train_config.json")
        if compress:
            compress_file(Path(tmp) / "model.safetensors")

    atomic_write_files(out, write)


def _load(name: str, dtype: str, device: str) -> int:
    from .loading import load_model

    t0 = time.perf_counter()
    model, tok = load_model(name, dtype=dtype, device=device)
    dt = time.perf_counter() - t0
    info = summarize(model)
    print(f"{name}: loaded in {dt:.1f} s")
    print(f"  parameters               {info.pop('parameters') / 1e6:.2f} M")
    for k, v in info.items():
        print(f"  {k:<24} {v}")
    print(f"  {'tokenizer':<24} {type(tok).__name__}, {len(tok)} tokens, bos={tok.bos_token!r} "
          f"eos={tok.eos_token!r} pad={tok.pad_token!r}, chat template: "
          f"{'yes' if tok.chat_template else 'no'}")
    return 0
