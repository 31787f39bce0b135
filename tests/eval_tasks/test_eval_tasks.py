"""lcx's lm-eval tasks, in process: data (modadd split, passkey sizing, ppl windows), scoring
(an oracle model scores 1.0 and a wrong one 0.0 on every task), and the `lcx` model.

The literal `lm_eval` command line and the start-up hook are in tests/eval_tasks/test_lmeval_cli.py.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

from lcx.data import modadd  # noqa: E402
from lcx.eval_tasks import TASK_NAMES, TASKS_DIR  # noqa: E402
from lcx.eval_tasks.common import coverage_order, int_list, n_tokens  # noqa: E402

# Byte tokenizer (tiny model): the passkey scaffold alone is ~260 tokens, so lengths start above.
LENGTHS = [300, 333, 512]
PPL_LENGTHS = [64, 97, 200]
LIMIT = 12
ALL_TASKS = ["passkey", "passkey_ll", "modadd_shift", "lcx_ppl"]


# --------------------------------------------------------------------------- modadd split
def test_modadd_split_is_deterministic_disjoint_and_half():
    s1, s2 = modadd.split_pairs(0), modadd.split_pairs(0)
    assert s1 == s2
    train, test = set(s1.train), set(s1.test)
    assert len(s1.train) == len(train) == modadd.N_PAIRS // 2 == 4704
    assert len(s1.test) == len(test) == modadd.N_PAIRS - 4704 == 4705
    assert not train & test
    assert train | test == set(modadd.all_pairs())
    assert modadd.split_pairs(1).test != s1.test


def test_modadd_split_is_pinned():
    """Training (issue 6) and evaluation must agree on the held-out half across versions."""
    import hashlib

    test = modadd.split_pairs(0).test
    assert test[:3] == ((73, 83), (65, 23), (24, 55))
    assert hashlib.sha256(repr(test).encode()).hexdigest()[:16] == "92bf5e166a67f4ec"


def test_modadd_templates_and_render():
    assert not set(modadd.TRAIN_TEMPLATES + modadd.NL_TRAIN_TEMPLATES) & set(modadd.OOD_TEMPLATES)
    assert modadd.CANONICAL in modadd.TRAIN_TEMPLATES
    for offset in (0, 1, 8, 129):
        text = modadd.render(96, 5, modadd.CANONICAL, offset)
        assert text.index("96+5=") == offset and text[:offset] == " " * offset
    assert modadd.answer(96, 5) == "4"
    assert modadd.render(3, 4, markers=True) == "<EXPR>3+4=</EXPR>"
    for t in modadd.OOD_TEMPLATES + modadd.NL_TRAIN_TEMPLATES:  # operands first among the numbers, never "97"
        nums = [int(x) for x in re.findall(r"\d+", t.format(a=11, b=22)) if x != "97"]
        assert nums[:2] == [11, 22]
    with pytest.raises(ValueError, match="a must be"):
        modadd.render(97, 0)
    with pytest.raises(ValueError, match="offset"):
        modadd.render(1, 2, offset=-1)


def test_coverage_order_and_int_list():
    assert coverage_order(1) == [0]
    assert coverage_order(2) == [0, 1]
    assert coverage_order(11)[:3] == [0, 10, 5]
    for n in (1, 2, 5, 11, 40):
        assert sorted(coverage_order(n)) == list(range(n))
    assert int_list("512,256", "x") == [256, 512]
    assert int_list("[4096]", "x") == [4096]
    with pytest.raises(ValueError, match="x"):
        int_list([0], "x")


# --------------------------------------------------------------------------- passkey data
@pytest.fixture(scope="module")
def byte_tok():
    from lcx.models.tiny import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="module")
def tok_meta(tiny_model_dir):
    return {"tokenizer": str(tiny_model_dir)}


def test_passkey_prompts_never_exceed_the_requested_length(byte_tok):
    from lcx.eval_tasks.passkey import data

    lengths = [270, 300, 333, 512, 1000]
    depths = data.depth_grid({"depths": 5})
    docs = data.make_docs(byte_tok, lengths, depths, samples=2, seed=0)
    assert len(docs) == 10
    longest_sentence = max(n_tokens(byte_tok, " " + s) for s in data.FILLER)
    for d in docs:
        assert d["lengths"] == lengths
        for L, prompt, count in zip(lengths, d["prompts"], d["prompt_tokens"]):
            assert count == n_tokens(byte_tok, prompt)
            with_answer = n_tokens(byte_tok, prompt) + data.SPARE_TOKENS + data.ANSWER_BUDGET
            assert with_answer <= L, (L, with_answer)  # prompt + BOS + the whole generation budget
            assert with_answer > L - longest_sentence - 2, "one more filler sentence would have fit"
            assert prompt.count(d["key"]) == 2 and prompt.endswith(data.QUESTION)
    # --limit 2 sees the shallowest and the deepest insertion
    assert [d["depth"] for d in docs[:2]] == [0.0, 1.0]
    shallow, deep = docs[0]["prompts"][-1], docs[1]["prompts"][-1]
    assert shallow.split("\n")[2].startswith("The pass key is")
    assert shallow.split("\n")[1] == "" and deep.split("\n")[3] == ""


def test_passkey_too_short_length_raises(byte_tok):
    from lcx.eval_tasks.passkey import data

    with pytest.raises(ValueError, match="too short"):
        data.make_docs(byte_tok, [64], [0.5], samples=1, seed=0)


def test_passkey_is_deterministic(byte_tok):
    from lcx.eval_tasks.passkey import data

    a = data.make_docs(byte_tok, [300], [0.0, 0.5, 1.0], 2, seed=3)
    b = data.make_docs(byte_tok, [300], [0.0, 0.5, 1.0], 2, seed=3)
    assert a == b
    assert len({d["key"] for d in a}) == len(a)


# --------------------------------------------------------------------------- lcx_ppl data
def test_ppl_windows_fit_and_are_nested(byte_tok):
    from lcx.eval_tasks.lcx_ppl import data

    docs = data.make_docs(byte_tok, PPL_LENGTHS, max_docs=40)
    tails = data.make_docs(byte_tok, PPL_LENGTHS, max_docs=40, tail=True)
    assert len(docs) == 40
    assert len({d["work"] for d in docs[:8]}) == 8, "docs are interleaved across held-out works"
    from lcx.data.corpus import VALIDATION_WORKS

    assert {d["work"] for d in docs} <= set(VALIDATION_WORKS)
    for d in docs:
        for L, text, count in zip(d["lengths"], d["prompts"], d["n_tokens"]):
            assert count == n_tokens(byte_tok, text) <= L
            assert count >= L - 1
        assert all(d["prompts"][-1].startswith(t) for t in d["prompts"])
    for d, t in zip(docs, tails):
        for L, whole, ctx, cont in zip(d["lengths"], d["prompts"], t["prompts"], t["continuations"]):
            assert ctx + cont == whole
            assert n_tokens(byte_tok, ctx) == L // 2
            assert n_tokens(byte_tok, ctx) + n_tokens(byte_tok, cont) <= L


# --------------------------------------------------------------------------- scoring
class _ScriptedLM(LM):
    """Answers from the prompt: right (`oracle`) or wrong. Rolling log-likelihood: 0 (oracle) or
    a uniform distribution over bytes, i.e. exactly 8 bits per byte (wrong)."""

    def __init__(self, right: bool):
        super().__init__()
        self.right = right

    @staticmethod
    def _answer(ctx: str) -> str:
        m = re.search(r"The pass key is (\d+)\. Remember it", ctx)
        if m:
            return m.group(1)
        a, b = [int(x) for x in re.findall(r"\d+", ctx) if x != "97"][:2]
        return str((a + b) % 97)

    def _say(self, ctx: str) -> str:
        ans = self._answer(ctx)
        return ans if self.right else str(int(ans) + 1)

    def generate_until(self, requests):
        return [f" {self._say(r.args[0])}." for r in requests]

    def loglikelihood(self, requests):
        out = []
        for r in requests:
            ctx, cont = r.args
            if cont.strip().isdigit():  # passkey_ll
                greedy = cont.strip() == self._say(ctx)
                out.append((0.0 if greedy else -5.0, greedy))
            else:  # lcx_ppl_tail: the continuation's bytes
                out.append((self._text_ll(cont), self.right))
        return out

    def _text_ll(self, text: str) -> float:
        return 0.0 if self.right else -8 * math.log(2) * len(text.encode())

    def loglikelihood_rolling(self, requests):
        return [self._text_ll(r.args[0]) for r in requests]


def _evaluate(lm, tasks, meta):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=meta)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=LIMIT, bootstrap_iters=0)["results"]


@pytest.fixture(scope="module")
def scored(tok_meta):
    meta = {**tok_meta, "max_seq_lengths": LENGTHS}
    ppl_meta = {**tok_meta, "max_seq_lengths": PPL_LENGTHS, "max_docs": LIMIT}
    out = {}
    for right in (True, False):
        res = _evaluate(_ScriptedLM(right), ["passkey", "passkey_ll", "modadd_shift"], meta)
        res.update(_evaluate(_ScriptedLM(right), ["lcx_ppl", "lcx_ppl_tail"], ppl_meta))
        out[right] = res
    return out


def _metrics(task_result: dict) -> dict:
    return {k.split(",")[0]: v for k, v in task_result.items() if k.endswith(",none") and "_stderr" not in k}


@pytest.mark.parametrize("right", [True, False], ids=["oracle", "wrong"])
def test_accuracy_tasks_score_exactly_one_or_zero(scored, right):
    res = scored[right]
    want = 1.0 if right else 0.0
    for task in ("passkey", "passkey_ll"):
        metrics = _metrics(res[task])
        assert set(metrics) == {str(L) for L in LENGTHS}, metrics
        assert all(v == want for v in metrics.values()), (task, metrics)
    for task, extra in (("modadd_shift_id", []),
                        ("modadd_shift_pos", [f"offset_{o}" for o in modadd.SHIFT_OFFSETS]),
                        ("modadd_shift_template", [f"template_{i}" for i in range(len(modadd.OOD_TEMPLATES))]),
                        ("modadd_shift", [])):
        metrics = _metrics(res[task])
        assert set(metrics) == {"exact_match", *extra}, (task, metrics)
        assert all(v == want for v in metrics.values()), (task, metrics)


@pytest.mark.parametrize("task", ["lcx_ppl", "lcx_ppl_tail"])
def test_perplexity_task_arithmetic(scored, task):
    for L in PPL_LENGTHS:
        oracle, wrong = scored[True][task], scored[False][task]
        assert oracle[f"word_perplexity_{L},none"] == 1.0
        assert oracle[f"bits_per_byte_{L},none"] == 0.0
        assert wrong[f"bits_per_byte_{L},none"] == pytest.approx(8.0, rel=1e-12)
        assert wrong[f"byte_perplexity_{L},none"] == pytest.approx(256.0, rel=1e-9)
        assert wrong[f"word_perplexity_{L},none"] > 256.0  # more than one byte per word


def test_every_task_yaml_is_known():
    import yaml

    names = set()
    for path in TASKS_DIR.glob("*/*.yaml"):
        text = path.read_text()
        m = re.search(r"^(task|group): (\S+)$", text, re.M)
        assert m, path
        names.add(m.group(2))
    assert names == set(TASK_NAMES)
    assert yaml  # the YAMLs parse in lm-eval's loader (exercised by the scoring tests)


# --------------------------------------------------------------------------- the lcx model
def test_lcx_model_args_are_checked():
    from lcx.lmeval_model import split_model_args

    cfg, hflm = split_model_args({"rope_type": "yarn", "factor": 4, "batch_size": 1, "trust_remote_code": True})
    assert cfg.to_dict() == {"rope": {"rope_type": "yarn", "factor": 4}} and hflm == {"batch_size": 1}
    cfg, _ = split_model_args({"attention": "sinks", "n_sink": 2, "window": 8})
    assert cfg.backend == "flash"  # the lcx model's default attention backend
    with pytest.raises(ValueError, match="unknown model_args.*'facter'"):
        split_model_args({"rope_type": "yarn", "facter": 4})
    with pytest.raises(ValueError, match="without rope_type"):
        split_model_args({"factor": 4})


def test_lcx_model_rejects_unknown_attention_and_its_keys(tiny_model_dir):
    from lcx.lmeval_model import LcxLM

    with pytest.raises(ValueError, match="attention='nope' is not known; known: .*lm_infinite"):
        LcxLM(pretrained=str(tiny_model_dir), attention="nope")
    with pytest.raises(ValueError, match="unknown model_args.*'window'"):
        LcxLM(pretrained=str(tiny_model_dir), attention="lm_infinite", n_global=2, n_local=8, window=3)


def test_lcx_model_applies_lm_infinite(tiny_model_dir):
    """attention=lm_infinite in model_args runs the same computation as lcx.methods directly."""
    import torch

    import lcx
    from lcx.lmeval_model import LcxLM
    from lcx.hf.attention_patch import attention_patched
    from lcx.methods import lm_infinite

    lm = LcxLM(pretrained=str(tiny_model_dir), attention="lm_infinite", n_global=2, n_local=16,
               rope_type="yarn", factor=2)
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = lm.model(ids).logits
        model, _ = lcx.load_model(str(tiny_model_dir))
        with lcx.patched(model, {"rope_type": "yarn", "factor": 2}), attention_patched(model, lm_infinite(2, 16)):
            want = model(ids).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3


def test_lcx_model_attention_backend_is_a_model_arg(tiny_model_dir):
    """attn_backend picks the lcx.attention backend (default flash); results agree across backends."""
    import torch

    from lcx.lmeval_model import DEFAULT_ATTN_BACKEND, LcxLM

    ids = torch.randint(3, 200, (1, 70), generator=torch.Generator().manual_seed(1))
    outs = {}
    for backend in (None, "blockwise", "ref"):
        kw = {} if backend is None else {"attn_backend": backend}
        lm = LcxLM(pretrained=str(tiny_model_dir), attention="sinks", n_sink=2, window=20, **kw)
        assert lm.model._lcx_attention_method.backend == (backend or DEFAULT_ATTN_BACKEND) == (backend or "flash")
        with torch.no_grad():
            outs[backend] = lm.model(ids).logits
    torch.testing.assert_close(outs[None], outs["ref"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["blockwise"], outs["ref"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend='nope' is not an lcx.attention backend"):
        LcxLM(pretrained=str(tiny_model_dir), attention="sinks", n_sink=2, window=20, attn_backend="nope")


@pytest.fixture(scope="module")
def yarn_lm(tiny_model_dir):
    from lcx.lmeval_model import DEFAULT_MAX_LENGTH, LcxLM

    lm = LcxLM(pretrained=str(tiny_model_dir), rope_type="yarn", factor=4, device="cuda:0")
    assert lm.max_length == DEFAULT_MAX_LENGTH and str(lm.device) == "cpu"
    assert lm.lcx_spec.rope_type == "yarn" and lm.lcx_spec.factor == 4
    return lm


def _reference_logprob(model_dir, text_ids, cont_ids, spec):
    import torch

    import lcx

    model, _ = lcx.load_model(model_dir)
    ids = torch.tensor([text_ids + cont_ids])
    with lcx.patched(model, spec), torch.no_grad():
        logp = model(ids[:, :-1]).logits.log_softmax(-1)[0]
    tgt = ids[0, 1:]
    lp = logp[torch.arange(len(tgt)), tgt]
    return lp[-len(cont_ids):].sum().item()


def test_lcx_model_scores_beyond_the_original_context(yarn_lm, tiny_model_dir):
    """300 + 5 tokens on a model with context 128: scored whole (no truncation), with YaRN."""
    from lm_eval.api.instance import Instance

    ctx, cont = "x" * 150 + "The grass is green. " * 6 + "The key is", " 12345"
    assert yarn_lm.model.config.max_position_embeddings == 128
    ids = yarn_lm.tokenizer(ctx, add_special_tokens=False).input_ids
    cids = yarn_lm.tokenizer(cont, add_special_tokens=False).input_ids
    assert len(ids) + len(cids) > 2 * 128
    req = Instance("loglikelihood", doc={}, arguments=(ctx, cont), idx=0)
    (ll, _greedy), = yarn_lm.loglikelihood([req], disable_tqdm=True)
    want = _reference_logprob(str(tiny_model_dir), ids, cids, {"rope_type": "yarn", "factor": 4})
    assert ll == pytest.approx(want, abs=1e-4)
    vanilla = _reference_logprob(str(tiny_model_dir), ids, cids, None)
    assert abs(ll - vanilla) > 1e-3, "the RoPE method is not in effect"

    roll = Instance("loglikelihood_rolling", doc={}, arguments=(ctx,), idx=0)
    (rl,) = yarn_lm.loglikelihood_rolling([roll], disable_tqdm=True)
    assert rl == pytest.approx(_reference_logprob(str(tiny_model_dir), [yarn_lm.prefix_token_id], ids,
                                                  {"rope_type": "yarn", "factor": 4}), abs=1e-3)

    gen = Instance("generate_until", doc={}, arguments=(ctx, {"until": ["\n"], "max_gen_toks": 4}), idx=0)
    (text,) = yarn_lm.generate_until([gen], disable_tqdm=True)
    assert isinstance(text, str) and len(yarn_lm.tokenizer(text, add_special_tokens=False).input_ids) <= 4


def test_lcx_model_generates_with_the_engine_as_hf_generate_does(tiny_model_dir):
    """generate_until's tokens come from lcx.engine (batched, bounded cache) and equal HF
    `generate` on the same patched model, one request at a time (HF's batched generate cannot
    pad an attention-method model); the engine really ran (its stats count the requests)."""
    import types

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from lcx.lmeval_model import LcxLM

    kw = dict(pretrained=str(tiny_model_dir), attention="lm_infinite", n_global=2, n_local=16,
              rope_type="yarn", factor=2)
    contexts = ["The quick brown fox jumps over the lazy dog. " * 3, "to be or not", "a b c d e f g h i j k l m n"]
    gen = {"until": ["zz"], "max_gen_toks": 24, "do_sample": False}
    reqs = [Instance("generate_until", None, (c, dict(gen)), i) for i, c in enumerate(contexts)]
    lm = LcxLM(batch_size=3, **kw)
    got = lm.generate_until(reqs)
    assert sum(lm.lcx_engine.stats.finished.values()) == len(contexts) and lm.lcx_engine.stats.max_batch_size == 3
    hf = LcxLM(batch_size=1, **kw)
    hf._model_generate = types.MethodType(HFLM._model_generate, hf)
    want = hf.generate_until([Instance("generate_until", None, (c, dict(gen)), i) for i, c in enumerate(contexts)])
    assert got == want
    assert all(len(g) > 0 for g in got)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([Instance("generate_until", None, (contexts[1], {**gen, "num_beams": 2}), 0)])
