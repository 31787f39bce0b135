"""`lcx train lm` on a micro config: loss goes down, runs are bitwise reproducible, resume is exact."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lcx.data import encode_documents, load_corpus, train_tokenizer
from lcx.data.io import environment
from lcx.train.lm import (
    ATTENTION_VARIANTS,
    ModelConfig,
    TrainConfig,
    batch_at,
    build_model,
    lr_at,
    train,
    val_windows,
)

MICRO_MODEL = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          max_position_embeddings=32)
MICRO = TrainConfig(model=MICRO_MODEL, steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5,
                    eval_every=10, ckpt_every=10, val_windows=16, seed=7)


@pytest.fixture(scope="module")
def data():
    train_docs = load_corpus("train")[::20]
    val_docs = load_corpus("validation")[:2]
    tok = train_tokenizer([d.text[:30_000] for d in train_docs], vocab_size=320)
    train_ids = encode_documents(tok, [d.text[:30_000] for d in train_docs])
    val_ids = encode_documents(tok, [d.text[:10_000] for d in val_docs])
    return tok, train_ids, val_ids


def _run(cfg, out, data, **kw):
    tok, train_ids, val_ids = data
    torch.set_num_threads(1)  # bitwise comparisons need one fixed reduction order
    return train(cfg, out, tokenizer=tok, train_ids=train_ids, val_ids=val_ids, progress=False, plot=False, **kw)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loss_decreases_and_outputs_are_an_hf_dir(tmp_path, data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = _run(MICRO, tmp_path, data)
    log = res.log
    assert len(log["loss"]) == MICRO.steps and log["step"] == list(range(1, MICRO.steps + 1))
    first, last = sum(log["loss"][:5]) / 5, sum(log["loss"][-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert math.isclose(log["loss"][0], math.log(320), rel_tol=0.05)  # init: ~uniform over the vocab
    assert log["val"][-1]["loss"] < log["val"][0]["loss"]
    assert [v["step"] for v in log["val"]] == [10, 20, 30, 40]
    assert log["tokens_seen"] == MICRO.steps * MICRO.batch_size * MICRO.seq_len
    assert log["final_val_loss"] == log["val"][-1]["loss"]
    # A plain HF directory: loads with Auto* and computes the same logits.
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "train_config.json", "train_log.json"} <= names
    assert "state.pt" not in names  # removed at the end unless keep_state
    assert json.loads((tmp_path / "train_config.json").read_text())["train_config"] == MICRO.to_dict()
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.tie_word_embeddings and tok.eos_token_id == model.config.eos_token_id
    ids = torch.tensor([data[1][:32]])
    res.model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, res.model(ids).logits)


def test_training_is_bitwise_reproducible(tmp_path, data):
    cfg = MICRO.replace(steps=12)
    a = _run(cfg, tmp_path / "a", data)
    b = _run(cfg, tmp_path / "b", data)
    assert a.log["loss"] == b.log["loss"] and a.log["val"] == b.log["val"]
    assert _same_weights(a.model, b.model)
    c = _run(cfg.replace(seed=8), tmp_path / "c", data)
    assert c.log["loss"] != a.log["loss"]


def test_resume_continues_identically(tmp_path, data):
    cfg = MICRO.replace(steps=25, ckpt_every=10)
    full = _run(cfg, tmp_path / "full", data)
    # Interrupted at step 13 (not a checkpoint multiple: stop_after writes its own checkpoint).
    # The CLI logs environment() (package versions) into the state: it must load back.
    part = _run(cfg, tmp_path / "resumed", data, stop_after=13, extra_log={"environment": environment()})
    assert len(part.log["loss"]) == 13 and (tmp_path / "resumed" / "state.pt").is_file()
    resumed = _run(cfg, tmp_path / "resumed", data, resume=True, extra_log={"environment": environment()})
    assert resumed.log["loss"] == full.log["loss"]
    assert resumed.log["val"] == full.log["val"]
    assert resumed.log["resumed_at_step"] == [13]
    assert _same_weights(resumed.model, full.model)
    assert not (tmp_path / "resumed" / "state.pt").exists()


def test_resume_rejects_a_different_config(tmp_path, data):
    cfg = MICRO.replace(steps=6)
    _run(cfg, tmp_path, data, stop_after=3)
    with pytest.raises(ValueError, match=r"config differs.*lr"):
        _run(cfg.replace(lr=5e-3), tmp_path, data, resume=True)


def test_batches_depend_only_on_seed_and_step():
    stream = torch.arange(1000, dtype=torch.int32)
    x1, y1 = batch_at(stream, MICRO, 5)
    x2, y2 = batch_at(stream, MICRO, 5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (MICRO.batch_size, MICRO.seq_len)
    assert torch.equal(y1[:, :-1], x1[:, 1:]) and torch.equal(y1, x1 + 1)  # targets shifted by one
    assert not torch.equal(batch_at(stream, MICRO, 6)[0], x1)


def test_val_windows_are_spread_and_disjoint():
    w = val_windows(torch.arange(10_000, dtype=torch.int32), 32, 16)
    assert w.shape == (16, 33) and w[0, 0] == 0 and w[-1, -1] == 9_999
    starts = w[:, 0]
    assert bool((starts[1:] - starts[:-1] >= 33).all())


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 55) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert lr_at(cfg, 100) == pytest.approx(0.1)
    lrs = [lr_at(cfg, s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_default_model_shape():
    cfg = TrainConfig()
    model = build_model(cfg.model, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 4.5e6 < n < 5.5e6, n
    c = model.config
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (64, 4, 2, 256)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert c.rope_parameters["rope_theta"] == 10000.0
    assert set(ATTENTION_VARIANTS) >= {"sdpa"}


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps"),
    ({"seq_len": 64}, "max_position_embeddings"),
    ({"lr": -1.0}, "lr"),
    ({"model": {"num_attention_heads": 3, "num_key_value_heads": 2}}, "multiple"),
    ({"model": {"attention": "swat-not-yet"}}, "attention"),
    ({"model": {"hidden": 8}}, "unknown ModelConfig key"),
    ({"stepz": 3}, "unknown TrainConfig key"),
])
def test_config_validation(bad, match):
    d = MICRO.to_dict()
    for k, v in bad.items():
        if k == "model":
            d["model"] = {**({} if "hidden" in v else d["model"]), **v}
        else:
            d[k] = v
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(d)


def test_cli_help():
    from lcx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "lm", "--help"])
    assert e.value.code == 0


@pytest.mark.parametrize("device, match", [("cuda", "cuda.is_available"), ("tpu9", "tpu9")])
def test_cli_device_is_checked_before_any_work(tmp_path, device, match):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from lcx.cli import main

    with pytest.raises(SystemExit, match=match):
        main(["train", "lm", "--out", str(tmp_path / "x"), "--steps", "2", "--device", device])
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_training_on_cuda_matches_cpu(tmp_path, data):
    """The same config on the GPU: the same batches, so the first steps' losses agree with the
    CPU run's up to float32 reduction order, and the run checkpoints and resumes there."""
    cfg = MICRO.replace(steps=12, ckpt_every=6)
    cpu = _run(cfg, tmp_path / "cpu", data)
    gpu = _run(cfg, tmp_path / "gpu", data, device="cuda")
    assert next(gpu.model.parameters()).is_cuda
    assert gpu.log["loss"][0] == pytest.approx(cpu.log["loss"][0], rel=1e-4)
    assert gpu.log["val"][-1]["loss"] == pytest.approx(cpu.log["val"][-1]["loss"], rel=2e-2)
    part = _run(cfg, tmp_path / "resumed", data, device="cuda", stop_after=6)
    assert len(part.log["loss"]) == 6
    resumed = _run(cfg, tmp_path / "resumed", data, device="cuda", resume=True)
    assert resumed.log["loss"][:6] == part.log["loss"] and len(resumed.log["loss"]) == 12
    assert json.loads((tmp_path / "gpu" / "train_config.json").read_text())["runtime"]["device"] == "cuda"
