"""Never a silent wrong length (issue #75, item 4): a task longer than the model's or the server's
limit fails with an error naming the task, its tokens, the limit and the flag that raises it;
lm-eval's left truncation (a "4096" passkey scored on ~1,011-token prompts, exit 0) is only there
when asked for (`allow_truncation=true`).

- the `lcx` model (`lm_eval --model lcx`) with `max_length=N`: generation (`passkey`),
  log-likelihood (`passkey_ll`) and rolling perplexity (`lcx_ppl`) past N raise; within N, and
  with `allow_truncation=true`, they run;
- the patched `local-completions` refuses before it sends anything (no server needed: the
  check runs on the client's tokens);
- slow tier: lm-eval's CLI against a real `lcx serve` (max_model_len 600): a task that fits runs
  and the server receives the whole prompt; one that does not exits non-zero naming the limit and
  `--max-model-len`, tokenized on the client or (`tokenizer_backend=None`) refused by the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")

from lcx.truncation import PromptTooLongError, allow_truncation  # noqa: E402

LIMIT = 400  # max_length: the tasks run at 384 tokens (fits) and 512 (does not; byte tokenizer)


def _evaluate(model_dir, tasks, lengths, **model_args):
    import lcx._lmeval_hook as hook
    from lm_eval import simple_evaluate

    hook.apply()
    args = ",".join([f"pretrained={model_dir}", *(f"{k}={v}" for k, v in model_args.items())])
    return simple_evaluate(model="lcx", model_args=args, tasks=tasks, limit=1,
                           metadata={"max_seq_lengths": lengths}, log_samples=False)


@pytest.mark.slow  # ~8-15 s each (lm-eval's task index); the default tier checks local-completions below
@pytest.mark.parametrize("task, kind", [("passkey", "generation"), ("passkey_ll", "log-likelihood"),
                                        ("lcx_ppl", "rolling")])
def test_lcx_model_refuses_a_task_past_max_length(tiny_model_dir, task, kind):
    with pytest.raises(PromptTooLongError) as e:
        _evaluate(tiny_model_dir, [task], [512], max_length=LIMIT)
    msg = str(e.value)
    assert task in msg and kind in msg and f"max_length {LIMIT}" in msg, msg
    assert "allow_truncation=true" in msg and "max_length=" in msg


@pytest.mark.slow
def test_lcx_model_runs_what_fits_and_cuts_only_when_asked(tiny_model_dir):
    res = _evaluate(tiny_model_dir, ["passkey_ll"], [384], max_length=LIMIT)
    assert "384,none" in res["results"]["passkey_ll"]
    res = _evaluate(tiny_model_dir, ["passkey_ll"], [512], max_length=LIMIT, allow_truncation="true")
    assert "512,none" in res["results"]["passkey_ll"]


def test_allow_truncation_values():
    assert allow_truncation("true") and allow_truncation(True) and not allow_truncation(None)
    assert not allow_truncation("false")
    with pytest.raises(ValueError, match="allow_truncation"):
        allow_truncation("maybe")


def _request(text, gen_kwargs=None, task="passkey"):
    args = (text,) if gen_kwargs is None else (text, gen_kwargs)
    return SimpleNamespace(args=args, task_name=task)


def test_local_completions_refuses_before_sending(tiny_model_dir):
    """The patched class checks on the client's tokens: nothing is sent (the URL is a closed port)."""
    import lcx._lmeval_hook as hook
    from lm_eval.api.registry import get_model

    hook.apply()
    cls = get_model("local-completions")
    lm = cls(model="m", base_url="http://127.0.0.1:9/v1/completions", tokenizer=str(tiny_model_dir),
             tokenizer_backend="huggingface", max_length=LIMIT, max_retries=1)
    long_text, short_text = "ab" * LIMIT, "ab" * 10
    with pytest.raises(PromptTooLongError) as e:  # a prompt that fits, but not with its generation budget
        lm.generate_until([_request(short_text, {"max_gen_toks": 16}),
                           _request("ab" * (LIMIT // 2 - 10), {"max_gen_toks": 64})])
    msg = str(e.value)
    assert "passkey" in msg and "64 to generate" in msg and f"max_length {LIMIT - 1}" in msg
    assert "--max-model-len" in msg and "max_length in --model_args" in msg
    with pytest.raises(PromptTooLongError, match="log-likelihood"):
        lm.loglikelihood([SimpleNamespace(args=(long_text, " 1"), task_name="passkey_ll")])
    with pytest.raises(PromptTooLongError, match="rolling"):
        lm.loglikelihood_rolling([_request(long_text, None, "lcx_ppl")])
    lenient = cls(model="m", base_url="http://127.0.0.1:9/v1/completions", tokenizer=str(tiny_model_dir),
                  tokenizer_backend="huggingface", max_length=LIMIT, max_retries=1, allow_truncation="true")
    assert lenient._lcx_allow_truncation and not lm._lcx_allow_truncation


# ================================================================================ against a server
@pytest.mark.slow  # a server + three lm_eval runs: ~1-2 min on 2 cores
def test_lm_eval_cli_against_a_server(tiny_model_dir, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "serve"))
    from _servers import lcx_serve, wait_healthy

    log = tmp_path / "server.log"
    with lcx_serve(tiny_model_dir, log, "--served-model-name", "tiny", "--max-model-len", "600", "--threads", "1",
                   "--max-batch", "4") as (url, proc):
        wait_healthy(url, proc, log)

        def run(task, length, *extra):
            args = f"model=tiny,base_url={url}/v1/completions,num_concurrent=1,max_retries=1," + ",".join(extra)
            cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args.rstrip(","),
                   "--tasks", task, "--limit", "1", "--metadata", json.dumps({"max_seq_lengths": [length]}),
                   "--output_path", str(tmp_path / f"out-{task}-{length}")]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

        tok = f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface"
        ok = run("passkey_ll", 512, tok)
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert "max_length=600, the server's max_model_len" in ok.stderr
        longest = httpx.get(f"{url}/stats", timeout=10).json()["prompts"]["longest"]
        assert 400 < longest <= 512, longest  # the whole 512-token prompt reached the server

        cut = run("passkey", 1024, tok)
        assert cut.returncode != 0
        assert "PromptTooLongError" in cut.stderr and "max_length 599" in cut.stderr, cut.stderr[-3000:]
        assert "--max-model-len" in cut.stderr and "passkey" in cut.stderr
        assert httpx.get(f"{url}/stats", timeout=10).json()["prompts"]["longest"] == longest  # nothing sent

        text = run("passkey", 1024, f"tokenizer={tiny_model_dir},tokenizer_backend=None")  # text: the server refuses
        assert text.returncode != 0
        assert "400" in text.stderr and "--max-model-len" in text.stderr, text.stderr[-3000:]


def test_report_cells_never_cut(tiny_model_dir):
    """`lcx report`'s cells evaluate the `lcx` model at its default limit (2**20 tokens) with cuts
    refused: a cell whose prompts would be cut fails with `PromptTooLongError`, never a number."""
    from lcx.lmeval_model import DEFAULT_MAX_LENGTH
    from lcx.method_config import MethodConfig
    from lcx.presets import PresetRun
    from lcx.report.config import ReportConfig
    from lcx.report.lm import lmeval_model

    lm = lmeval_model(PresetRun("vanilla", str(tiny_model_dir), MethodConfig()), ReportConfig(model=str(tiny_model_dir)))
    assert lm.max_length == DEFAULT_MAX_LENGTH and lm._check_lengths() is not None
    lm._max_length = 64  # a limit under the document, as a cell past its limit would meet it
    with pytest.raises(PromptTooLongError, match="rolling"):
        lm.loglikelihood_rolling([SimpleNamespace(args=("ab" * 64,), task_name="lcx_ppl")])
