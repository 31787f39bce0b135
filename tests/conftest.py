"""Shared pytest fixtures and markers for lcx.

Tests never touch the network: the Hugging Face hub is switched off before anything imports
transformers. Tests marked `gpu` are skipped when CUDA is unavailable.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# One torch thread in every test process (LCX_TEST_THREADS=N for more): the tests' models are tiny,
# and on CI's 2 shared cores two OpenMP threads spin against each other -- an engine case of the
# family grid took 4-6x longer with torch's default 2 threads than with 1 beside other work
# (measured 2026-12-01: 6.9-7.4 s against 1.0-1.9 s for the same three cases). Set before torch is
# imported, so this process and the processes the tests start (servers, CLIs) begin with it; a
# test that sets another count is undone before the next (`_test_threads`). Tests of threading
# itself set their own count (tests/test_threads.py, the C++ kernel's two-thread case).
TEST_THREADS = int(os.environ.get("LCX_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _test_threads():
    """Every test starts with `TEST_THREADS` torch threads (an earlier test may have set another
    count through `--threads`/`LCX_THREADS` and kept it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)
    yield


# LCX_TEST_PROGRESS=FILE: each test's id is written there as it starts, so a run stopped from
# outside (CI's deadline, .ci/run) can say which test it was in even when pytest itself cannot.
_PROGRESS = os.environ.get("LCX_TEST_PROGRESS")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _PROGRESS:
        with open(_PROGRESS, "w") as f:
            f.write(nodeid + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    import torch  # only now: no device query at import time

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for it in gpu_items:
        it.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With LCX_FAILURES_LOG=<file>, append each failure (id, phase, short traceback) the moment
    it happens: a run killed at its time limit (the GPU session's stages) still names what failed
    and why, which pytest's own summary and junit XML only write at the end."""
    path = os.environ.get("LCX_FAILURES_LOG")
    if not path or not report.failed:
        return
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = text.splitlines()
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n" + "\n".join(lines[-25:]) + "\n\n")


@pytest.fixture(scope="session")
def tiny_model():
    """`(model, tokenizer)` from `lcx.models.tiny_llama(seed=0)`: 2 layers, hidden 64, 4/2 heads,
    head_dim 16, vocab 259 (byte tokenizer). Shared by the whole session: do not mutate it
    (or undo what you did, e.g. `lcx.unpatch`); call `tiny_llama()` for a private copy."""
    from lcx.models.tiny import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A Hugging Face directory holding the `tiny_model` weights and tokenizer (read-only)."""
    from lcx.models.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """A Hugging Face directory holding a tiny random Gemma 3 (`gemma3_text`: one sliding layer of
    window 32 with its own RoPE base, one global layer; context 128, q/k norms,
    `query_pre_attn_scalar` scaling) with the tiny Llama's byte tokenizer (read-only)."""
    from lcx.hf.models import tiny_model
    from lcx.models.tiny import tiny_llama

    path = tmp_path_factory.mktemp("tiny-gemma3") / "model"
    tiny_model("gemma3_text", seed=0, vocab_size=259, max_position_embeddings=128, sliding_window=32).save_pretrained(path)
    tiny_llama(seed=0)[1].save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vllm_python():
    """The python that runs vLLM (`lcx.serve.vllm_plugin.launch.vllm_python`), or skip the test;
    with `LCX_REQUIRE_VLLM=1` (CI's vLLM step) a missing vLLM fails it instead."""
    from lcx.serve.vllm_plugin.launch import VllmNotInstalled, vllm_python

    try:
        return vllm_python()
    except VllmNotInstalled as e:
        if os.environ.get("LCX_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(e))
