"""The modular-addition study (`lcx train modadd`): configs, data, models, training, resumable
study runner, aggregation, and the decoder export evaluated through lm-eval's `lcx` model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lcx.data import modadd
from studies.modadd.model import POSITION_ENCODINGS, EncoderConfig, ModAddEncoder
from studies.modadd import study as study_module
from studies.modadd.aggregate import aggregate
from studies.modadd.cli import _study_from_arg
from studies.modadd.config import RunConfig, StudyConfig, load_run
from studies.modadd.data import DIGIT_IDS, MASK_ID, batch_at, mask_characters, pack, sample_texts
from studies.modadd.decoder import DecoderConfig, decoder_accuracy, train_decoder
from studies.modadd.evaluation import CURVE_SPLITS, PLACE_VALUE_SHIFTS, place_value_errors
from studies.modadd.recipes import INTERVENTIONS, Recipe, recipe_by_name
from studies.modadd.study import DEFAULT_STUDY, run_study
from studies.modadd.training import make_optimizer, build_model, loss_fn, symmetric_kl, train_run

ROOT = Path(__file__).resolve().parents[2]
PE_NAMES = sorted(POSITION_ENCODINGS)
BATCH_SIZES = (1, 3)
TINY_MODEL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64}
# A study small enough for tests: 2 configurations x 1 seed, a few steps each.
TINY_RUN = {"steps": 3, "batch_size": 8, "eval_pairs": 7, "eval_offsets": [0, 8, 32, 128], "model": TINY_MODEL}
TINY_STUDY = StudyConfig(configs=(("baseline", "learned"), ("robust", "rope")), seeds=(0,), run=TINY_RUN)




def _numbers(ids: torch.Tensor, length: int) -> list[int]:
    text = bytes(int(i) - modadd.N_SPECIAL for i in ids[1:length]).decode()
    return [int(x) for x in re.findall(r"\d+", text)][:2]


# --------------------------------------------------------------------------- configs
@pytest.mark.parametrize("make, key", [
    (lambda: RunConfig.from_dict({"bogus_key": 1}), "bogus_key"),
    (lambda: RunConfig(position="sinusoid"), "position"),
    (lambda: RunConfig(recipe="robust-no_dropout"), "no_dropout"),
    (lambda: RunConfig(recipe="fancy"), "fancy"),
    (lambda: RunConfig(recipe="baseline+dropout"), "+dropout"),
    (lambda: RunConfig(steps=0), "steps"),
    (lambda: RunConfig(eval_offsets=(0, 8)), "eval_offsets"),
    (lambda: RunConfig(recipe="robust", batch_size=7), "batch_size"),
    (lambda: RunConfig(eval_offsets=(0, 8, 32, 128, 300)), "max_positions"),
    (lambda: Recipe(max_offset=-1), "max_offset"),
    (lambda: Recipe(curriculum=1), "curriculum"),
    (lambda: Recipe(template_pool="english"), "template_pool"),
    (lambda: Recipe.from_dict({"mixup": True}), "mixup"),
    (lambda: EncoderConfig(d_model=130), "n_heads"),
    (lambda: EncoderConfig.from_dict({"width": 3}), "width"),
    (lambda: DecoderConfig(recipe="robust"), "consistency"),
    (lambda: StudyConfig(configs=(("robust",),)), "(recipe, position)"),
    (lambda: DecoderConfig.from_dict({"layers": 3}), "layers"),
    (lambda: StudyConfig(run={"seed": 3}), "seed"),
    (lambda: Recipe(offset_sampling="row"), "offset_sampling"),
    (lambda: Recipe(curriculum_delay_frac=1.0), "curriculum_delay_frac"),
    (lambda: Recipe(consistency_ramp_frac=-0.1), "consistency_ramp_frac"),
    (lambda: recipe_by_name("robust~markers=false"), "~field=value"),
    (lambda: recipe_by_name("robust~lr=0.1"), "~field=value"),
    (lambda: RunConfig(tag="a b"), "tag"),
    (lambda: StudyConfig(configs=(("robust", "learned", {"lr": 0.1}),)), "tag"),
    (lambda: StudyConfig(configs=(("robust", "learned", {"tag": "x", "seed": 1}),)), "seed"),
    (lambda: StudyConfig(configs=(("robust", "learned"), ("robust", "learned"))), "same name"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_config_errors_name_the_key(make, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        make()


def test_recipes_and_ablation_names():
    robust = recipe_by_name("robust")
    assert all(getattr(robust, f) for f in INTERVENTIONS)
    assert not any(getattr(recipe_by_name("baseline"), f) for f in INTERVENTIONS)
    for f in INTERVENTIONS:
        r = recipe_by_name(f"robust-no_{f}")
        assert [g for g in INTERVENTIONS if not getattr(r, g)] == [f]
    for f in INTERVENTIONS:
        r = recipe_by_name(f"baseline+{f}")
        assert [g for g in INTERVENTIONS if getattr(r, g)] == [f]
    assert recipe_by_name("baseline+markers+templates-no_markers") == recipe_by_name("baseline+templates")
    assert RunConfig.from_dict(RunConfig(recipe="robust-no_markers").to_dict()) == RunConfig(
        recipe="robust-no_markers")


def test_template_pools():
    """robust draws symbolic formats only; robust_nl adds the natural-language ones; none is OOD."""
    pairs = modadd.split_pairs(0).train[:400]
    for name, pool in (("robust", modadd.TRAIN_TEMPLATES),
                       ("robust_nl", modadd.TRAIN_TEMPLATES + modadd.NL_TRAIN_TEMPLATES)):
        recipe = recipe_by_name(name)
        texts = sample_texts(recipe, pairs, random.Random(0), 0)
        bodies = {t.strip()[len(modadd.EXPR_OPEN):-len(modadd.EXPR_CLOSE)] for t in texts}
        used = {tpl for tpl in pool for (a, b) in pairs if tpl.format(a=a, b=b) in bodies}
        assert used == set(pool), name
    assert recipe_by_name("robust_nl-no_templates") == recipe_by_name("robust-no_templates").__class__(
        markers=True, curriculum=True, consistency=True, template_pool="mixed")


def test_curriculum_widens_linearly():
    r = Recipe(curriculum=True, max_offset=32, curriculum_frac=0.5)
    assert [r.max_offset_at(s, 100) for s in (0, 24, 49, 50, 99)] == [1, 16, 32, 32, 32]
    assert Recipe().max_offset_at(99, 100) == 0
    delayed = recipe_by_name("robust~curriculum_delay_frac=0.2")
    assert [delayed.max_offset_at(s, 100) for s in (0, 19, 20, 44, 69, 99)] == [0, 0, 1, 16, 32, 32]


def test_template_mixture_can_start_late():
    r = recipe_by_name("robust~template_delay_frac=0.3")
    assert [r.templates_at(s, 100) for s in (0, 29, 30, 99)] == [False, False, True, True]
    assert recipe_by_name("robust").templates_at(0, 100)
    assert not recipe_by_name("robust-no_templates").templates_at(99, 100)
    cfg = RunConfig(recipe="robust~template_delay_frac=0.3~curriculum_delay_frac=0.3", steps=100,
                       batch_size=64, model=TINY_MODEL)
    pairs = modadd.split_pairs(0).train

    def canonical_rows(step):  # markers wrap a canonical expression at offset 0: "<EXPR>a+b=</EXPR>"
        ids, lengths, _, _ = batch_at(cfg, pairs, step)
        texts = [bytes(i - 3 for i in row[1:n].tolist()).decode() for row, n in zip(ids, lengths)]
        return sum(re.fullmatch(r"<EXPR>\d+\+\d+=</EXPR>", t) is not None for t in texts)

    assert canonical_rows(10) == 64  # delay: canonical at offset 0 only
    assert canonical_rows(80) < 32  # after it: the mixture, at offsets up to 32


def test_recipe_modifiers_and_schedules():
    r = recipe_by_name("robust-no_markers~offset_sampling=example~consistency_ramp_frac=0.5~max_offset=16")
    assert (r.markers, r.curriculum, r.offset_sampling, r.consistency_ramp_frac, r.max_offset) == (
        False, True, "example", 0.5, 16)
    assert [r.consistency_weight_at(s, 100) for s in (0, 24, 49, 99)] == [0.02, 0.5, 1.0, 1.0]
    assert recipe_by_name("robust").consistency_weight_at(0, 100) == 1.0
    assert recipe_by_name("baseline").consistency_weight_at(50, 100) == 0.0
    # the KL term is weighted by the schedule: at step 0 of a ramp it is (almost) off
    cfg = RunConfig(recipe="robust~consistency_ramp_frac=0.5", steps=100, batch_size=8, model=TINY_MODEL)
    model = build_model(cfg)
    batch = batch_at(cfg, modadd.split_pairs(0).train, 10)
    ce = loss_fn(model, cfg, *batch, step=0)[1]["ce"]
    loss0, parts = loss_fn(model, cfg, *batch, step=0)
    loss_full, _ = loss_fn(model, cfg, *batch)
    assert loss0.item() == pytest.approx(ce + 0.02 * parts["kl"], rel=1e-5)
    assert loss_full.item() == pytest.approx(ce + parts["kl"], rel=1e-5)


def test_consistency_loss_can_start_late():
    r = recipe_by_name("robust~consistency_delay_frac=0.4~consistency_ramp_frac=0.1")
    assert [r.consistency_at(s, 100) for s in (0, 39, 40, 99)] == [False, False, True, True]
    # the ramp counts from the start of the loss
    assert [r.consistency_weight_at(s, 100) for s in (0, 39, 40, 44, 49, 99)] == [0.0, 0.0, 0.1, 0.5, 1.0, 1.0]
    staged = recipe_by_name("robust_staged")
    assert (staged.curriculum_delay_frac, staged.template_delay_frac, staged.consistency_delay_frac,
            staged.template_pool) == (0.1, 0.5, 0.5, "mixed")
    cfg = RunConfig(recipe="robust_staged", steps=100, batch_size=8, model=TINY_MODEL)
    pairs = modadd.split_pairs(0).train
    model = build_model(cfg)
    # before the delay: 8 distinct pairs, plain cross-entropy; after it: 4 pairs rendered twice + KL
    ids, lengths, labels, n = batch_at(cfg, pairs, 10)
    assert n == 8 and len(ids) == 8
    loss, parts = loss_fn(model, cfg, ids, lengths, labels, n, step=10)
    assert set(parts) == {"ce"} and loss.item() == pytest.approx(parts["ce"])
    ids, lengths, labels, n = batch_at(cfg, pairs, 60)
    assert n == 4 and len(ids) == 8 and torch.equal(labels[:4], labels[4:])
    assert set(loss_fn(model, cfg, ids, lengths, labels, n, step=60)[1]) == {"ce", "kl"}


def test_offset_sampling_per_batch_or_per_example():
    pairs = modadd.split_pairs(0).train[:64]

    def offsets(name):
        texts = sample_texts(recipe_by_name(name), pairs, random.Random(3), 32)
        return {len(t) - len(t.lstrip(modadd.PAD)) for t in texts}

    assert len(offsets("baseline+curriculum")) == 1
    assert len(offsets("baseline+curriculum~offset_sampling=example")) > 10


# --------------------------------------------------------------------------- data
def test_training_batches_use_only_train_pairs_and_eval_uses_the_task_pairs():
    from lcx.eval_tasks.modadd_shift.data import make_docs

    split = modadd.split_pairs(0)
    train = set(split.train)
    assert not train & set(split.test)
    for recipe in ("baseline", "robust"):
        cfg = RunConfig(recipe=recipe, batch_size=16, steps=10)
        for step in (0, 9):
            ids, lengths, labels, n = batch_at(cfg, split.train, step)
            for i in range(ids.shape[0]):
                a, b = _numbers(ids[i], int(lengths[i]))
                assert (a, b) in train and labels[i] == (a + b) % 97
    docs = make_docs("id", {"num_pairs": 25})
    assert [(d["a"], d["b"]) for d in docs] == list(split.test[:25])  # evaluate() reads split.test too


def test_consistency_batch_pairs_rows_and_kl():
    cfg = RunConfig(recipe="robust", batch_size=12, steps=100)
    ids, lengths, labels, n = batch_at(cfg, modadd.split_pairs(0).train, 80)
    assert n == 6 and torch.equal(labels[:n], labels[n:])
    assert [_numbers(ids[i], int(lengths[i])) for i in range(n)] == \
        [_numbers(ids[i + n], int(lengths[i + n])) for i in range(n)]
    x = torch.randn(5, 97)
    assert symmetric_kl(x, x).abs() < 1e-6 and symmetric_kl(x, torch.randn(5, 97)) > 0.1


def test_batches_are_a_function_of_seed_and_step():
    cfg = RunConfig(recipe="robust", batch_size=8)
    train = modadd.split_pairs(0).train
    assert torch.equal(batch_at(cfg, train, 5)[0], batch_at(cfg, train, 5)[0])
    assert not torch.equal(batch_at(cfg, train, 5)[0], batch_at(cfg, train, 6)[0])


# --------------------------------------------------------------------------- models
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("pe", PE_NAMES)
def test_encoder_forward_backward(pe, batch):
    torch.manual_seed(0)
    model = ModAddEncoder(EncoderConfig(position=pe, **TINY_MODEL))
    texts = [modadd.render(12, 34, t, o) for t, o in zip(modadd.TRAIN_TEMPLATES, (0, 5, 17))][:batch]
    ids, lengths = pack(texts)
    logits = model(ids, lengths)
    assert logits.shape == (batch, 97) and torch.isfinite(logits).all()
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.tok.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("pe", PE_NAMES)
def test_encoder_padding_does_not_change_logits(pe):
    torch.manual_seed(0)
    model = ModAddEncoder(EncoderConfig(position=pe, **TINY_MODEL)).eval()
    short, long = modadd.render(3, 4), modadd.render(50, 60, modadd.OOD_TEMPLATES[0], 9)
    alone = model(*pack([short]))
    together = model(*pack([short, long]))[:1]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", PE_NAMES)
def test_cls_only_last_block_equals_the_full_encoder(pe):
    """The last block computes the [CLS] query alone: same logits as running it on every token."""
    torch.manual_seed(0)
    model = ModAddEncoder(EncoderConfig(position=pe, **TINY_MODEL)).double().eval()
    ids, lengths = pack([modadd.render(5, 61, t, o) for t, o in zip(modadd.TRAIN_TEMPLATES, (0, 3, 11))])
    fast = model(ids, lengths)
    B, T = ids.shape
    pos = torch.arange(T)
    keep = pos[None] < lengths[:, None]
    mask = torch.zeros(B, 1, 1, T, dtype=torch.float64).masked_fill(~keep[:, None, None], float("-inf"))
    bias = model.pe.bias(pos)
    if bias is not None:
        mask = mask + bias[None].double()
    h = model.pe.embed(model.tok(ids), pos)
    for blk in model.blocks:
        h = blk(h, pos, model.pe, mask)  # every query
    torch.testing.assert_close(fast, model.head(model.ln_f(h[:, 0])), atol=1e-12, rtol=0)


@pytest.mark.parametrize("pe", PE_NAMES)
def test_position_semantics(pe):
    """Only NoPE is blind to order: permuting the characters leaves its logits unchanged."""
    torch.manual_seed(0)
    model = ModAddEncoder(EncoderConfig(position=pe, **TINY_MODEL)).eval()
    a, b = model(*pack(["12+34="])), model(*pack(["=43+21"]))
    assert torch.allclose(a, b, atol=1e-5) == (pe == "nope")


def test_alibi_bias_is_symmetric_distance():
    model = ModAddEncoder(EncoderConfig(position="alibi", **TINY_MODEL))
    bias = model.pe.bias(torch.arange(3))
    m = torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])  # alibi_slopes(4)
    want = -m[:, None, None] * torch.tensor([[0., 1, 2], [1, 0, 1], [2, 1, 0]])
    torch.testing.assert_close(bias, want)


# --------------------------------------------------------------------------- training
def test_tiny_training_run_learns():
    """A short run on 24 training pairs: the loss falls far below chance (ln 97) and the pairs
    it trained on are mostly answered right (chance: 1/97)."""
    cfg = RunConfig(steps=60, batch_size=32, lr=3e-3, weight_decay=0.0, warmup_steps=5, train_pairs=24,
                       eval_pairs=24, eval_offsets=(0, 8, 32, 128), model=TINY_MODEL)
    _, res = train_run(cfg, progress=False, log_every=5)
    assert res["curve"]["loss"][-1] < math.log(97) - 2.0, res["curve"]["loss"]
    assert res["metrics"]["train_id"] > 0.5, res["metrics"]
    assert set(res["metrics"]["shift"]) == {"0", "8", "32", "128"}
    assert 0 <= res["metrics"]["pos"] <= 1 and len(res["metrics"]["templates"]) == len(modadd.OOD_TEMPLATES)


def test_learning_curve_every_n_steps():
    cfg = RunConfig(steps=7, batch_size=8, eval_pairs=5, eval_offsets=(0, 8, 32, 128), eval_every=3,
                       model=TINY_MODEL)
    _, res = train_run(cfg, progress=False)
    learning = res["curve"]["learning"]
    assert learning["step"] == [3, 6, 7]
    assert set(learning) == {"step", *CURVE_SPLITS}
    assert all(len(learning[k]) == 3 and all(0 <= v <= 1 for v in learning[k]) for k in CURVE_SPLITS)
    _, plain = train_run(dataclasses.replace(cfg, eval_every=0), progress=False)
    assert "learning" not in plain["curve"]
    # the curve's evaluations do not change training
    assert plain["curve"]["loss"] == res["curve"]["loss"]


# --------------------------------------------------------------------------- study: resume + aggregate
def test_study_resumes_and_redoes_corrupt_runs(tmp_path, monkeypatch):
    calls = []
    real = train_run

    def counting(cfg, **kw):
        calls.append(cfg.name)
        return real(cfg, **kw)

    monkeypatch.setattr(study_module, "train_run", counting)
    run_study(TINY_STUDY, tmp_path, progress=False, log=lambda *_: None)
    names = [c.name for c in TINY_STUDY.run_configs()]
    assert calls == names
    assert (tmp_path / "table.md").is_file() and (tmp_path / "shift.png").is_file()
    assert (tmp_path / "ablation.png").is_file() and (tmp_path / "study_config.json").is_file()

    calls.clear()
    run_study(TINY_STUDY, tmp_path, progress=False, log=lambda *_: None)
    assert calls == []  # everything finished: nothing is retrained

    first, second = (tmp_path / "runs" / f"{n}.json" for n in names)
    first.write_text(first.read_text()[:40])  # a crash mid-write (without the atomic rename)
    other = json.loads(second.read_text())
    other["config"]["steps"] = 99  # a run made with another config
    second.write_text(json.dumps(other))
    run_study(TINY_STUDY, tmp_path, progress=False, log=lambda *_: None)
    assert calls == names
    assert load_run(first, TINY_STUDY.run_configs()[0]) is not None
    # a recipe redefined since the run was made (the run file stores the resolved recipe): rerun
    stale = json.loads(second.read_text())
    stale["recipe"]["consistency_weight"] = 0.5
    second.write_text(json.dumps(stale))
    assert load_run(second, TINY_STUDY.run_configs()[1]) is None
    del stale["recipe"]["offset_sampling"]  # a field added later: its default still matches
    stale["recipe"]["consistency_weight"] = 1.0
    second.write_text(json.dumps(stale))
    assert load_run(second, TINY_STUDY.run_configs()[1]) is not None


def _fake_run(runs: Path, recipe: str, position: str, seed: int, acc: float) -> None:
    cfg = RunConfig(recipe=recipe, position=position, seed=seed)
    shift = {str(o): acc / (1 + o) for o in cfg.eval_offsets}
    metrics = {"id": acc, "pos": acc / 2, "template": acc / 4, "train_id": 1.0, "shift": shift, "templates": [acc / 4] * 5}
    (runs / f"{cfg.name}.json").write_text(json.dumps({"name": cfg.name, "config": cfg.to_dict(), "metrics": metrics,
                                                       "train_s": 1.0}))


def test_aggregate_table_from_run_files(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed, acc in ((0, 0.5), (1, 0.7), (2, 0.9)):
        _fake_run(runs, "baseline", "learned", seed, acc)
    _fake_run(runs, "robust", "learned", 0, 1.0)
    (runs / "junk.json").write_text("{not json")
    study = StudyConfig(configs=(("baseline", "learned"), ("robust", "learned")), seeds=(0, 1, 2))
    table = aggregate(tmp_path, study)
    base, robust = table["rows"]
    assert base["id"]["mean"] == pytest.approx(0.7) and base["id"]["std"] == pytest.approx(0.2)
    assert base["template"]["mean"] == pytest.approx(0.175) and base["seeds"] == [0, 1, 2]
    assert base["shift"]["8"]["mean"] == pytest.approx(0.7 / 9)
    assert robust["id"] == {"mean": 1.0, "std": 0.0}
    assert table["missing_runs"] == ["robust__learned__s1", "robust__learned__s2"]
    assert table["run_seconds"] == pytest.approx(4.0) and table["n_runs"] == 4  # junk.json is skipped
    md = (tmp_path / "table.md").read_text()
    assert "| baseline | learned | 3 | 70.0 ± 20.0 | 35.0 ± 10.0 | 17.5 ± 5.0 | 100.0 ± 0.0 |" in md
    assert json.loads((tmp_path / "table.json").read_text())["rows"][0]["id"]["mean"] == pytest.approx(0.7)


def test_tagged_configs_aggregate_separately_with_learning_curves(tmp_path):
    study = StudyConfig(configs=(("baseline", "learned"), ("baseline", "learned", {"tag": "hot", "lr": 3e-3})),
                           seeds=(0,), run={**TINY_RUN, "steps": 4, "eval_every": 2})
    names = [c.name for c in study.run_configs()]
    assert names == ["baseline__learned__s0", "baseline__learned__hot__s0"]
    assert [c.lr for c in study.run_configs()] == [1e-3, 3e-3]
    assert StudyConfig.from_dict(json.loads(json.dumps(study.to_dict()))) == study
    run_study(study, tmp_path, progress=False, log=lambda *_: None)
    table = json.loads((tmp_path / "table.json").read_text())
    assert [(r["recipe"], r.get("tag")) for r in table["rows"]] == [("baseline", None), ("baseline", "hot")]
    assert all(r["learning"]["step"] == [2, 4] for r in table["rows"])
    assert "| baseline [hot] | learned | 1 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "learning.png").is_file()


def test_study_presets_and_config_files(tmp_path):
    assert _study_from_arg("default") is DEFAULT_STUDY
    long = _study_from_arg("long")
    assert long.run["steps"] == 4 * DEFAULT_STUDY.run["steps"]
    assert {c.recipe for c in long.run_configs()} >= {"baseline", "robust"}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(TINY_STUDY.to_dict()))
    assert _study_from_arg(str(path)).run_configs() == TINY_STUDY.run_configs()
    with pytest.raises(ValueError, match="neither a committed study"):
        _study_from_arg("longest")
    assert all(c.eval_every for c in _study_from_arg("diagnosis").run_configs())
    # the default study holds every leave-one-out ablation of the robust recipe
    assert {(f"robust-no_{i}", "learned") for i in INTERVENTIONS} <= set(DEFAULT_STUDY.configs)


# --------------------------------------------------------------------------- decoder export + lm-eval
@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("modadd") / "decoder"
    cfg = DecoderConfig(steps=10, batch_size=16, eval_pairs=5, hidden_size=32, intermediate_size=64)
    train_decoder(cfg, out, progress=False)
    return out


def test_decoder_export_loads_offline_and_greedy_matches_teacher_forcing(decoder_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(decoder_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(decoder_dir, local_files_only=True).eval()
    prompt = modadd.render(12, 34, modadd.CANONICAL, 8)
    assert tok(prompt, add_special_tokens=False).input_ids == modadd.encode_chars(prompt)
    assert tok.decode(modadd.encode_chars(prompt + "5\n")) == prompt + "5\n"
    meta = json.loads((decoder_dir / "train_config.json").read_text())
    assert set(meta["metrics"]) >= {"id", "pos", "template"}
    # The teacher-forced check counts a prompt right iff greedy generation emits answer + "\n".
    pairs = modadd.split_pairs(0).test[:6]
    for a, b in pairs:
        p = modadd.render(a, b, modadd.CANONICAL, 0)
        ids = torch.tensor([modadd.encode_chars(p)])
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        text = tok.decode(gen[0, ids.shape[1]:])
        right = text.split("\n")[0] == modadd.answer(a, b) and "\n" in text
        assert right == (decoder_accuracy(model, [p], [modadd.answer(a, b)]) == 1.0), (p, text)


def _lmeval_in_process(pretrained: str, limit: int) -> dict:
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lcx.eval_tasks import TASKS_DIR
    from lcx.lmeval_model import LcxLM

    tm_ = TaskManager(include_path=str(TASKS_DIR))
    lm = LcxLM(pretrained=pretrained, batch_size=8)
    return simple_evaluate(model=lm, tasks=["modadd_shift"], task_manager=tm_, limit=limit,
                           bootstrap_iters=0)["results"]


@pytest.mark.slow
def test_lmeval_lcx_model_evaluates_the_exported_decoder(decoder_dir):
    """lm-eval's `lcx` model on the export: the same numbers as the trainer's own check."""
    limit = 4
    res = _lmeval_in_process(str(decoder_dir), limit)
    assert {"modadd_shift", "modadd_shift_id", "modadd_shift_pos", "modadd_shift_template"} <= set(res)
    model, _ = __import__("lcx").load_model(str(decoder_dir))
    pairs = modadd.split_pairs(0).test[:limit]
    answers = [modadd.answer(a, b) for a, b in pairs]
    want_id = decoder_accuracy(model, [modadd.render(a, b) for a, b in pairs], answers)
    assert res["modadd_shift_id"]["exact_match,none"] == pytest.approx(want_id)
    want_128 = decoder_accuracy(model, [modadd.render(a, b, offset=128) for a, b in pairs], answers)
    assert res["modadd_shift_pos"]["offset_128,none"] == pytest.approx(want_128)


COMMITTED_DECODER = ROOT / "results" / "modadd" / "decoder"


def _committed_decoder(tmp_path: Path) -> Path:
    """The committed decoder export: results/modadd/decoder itself where its weights are there, else a
    copy in `tmp_path` with the weights restored from git's history as its weights.json says (sha256
    checked; the weights left the tracked tree in #45; a shallow clone fetches their commit from origin).
    Skips where git cannot give them (a shallow clone whose origin cannot be reached)."""
    if any(COMMITTED_DECODER.glob("model*.safetensors*")):
        return COMMITTED_DECODER
    from lcx.train.build import WEIGHTS, committed_weights

    data, why = committed_weights(COMMITTED_DECODER, json.loads((COMMITTED_DECODER / "weights.json").read_text()))
    if data is None:
        pytest.skip(f"the committed decoder's weights are not here: {why}")
    out = tmp_path / "decoder"
    out.mkdir()
    for f in COMMITTED_DECODER.iterdir():
        if f.is_file() and f.name != "weights.json":
            (out / f.name).write_bytes(f.read_bytes())
    (out / WEIGHTS).write_bytes(data)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not (COMMITTED_DECODER / "config.json").is_file(), reason="no committed decoder export")
def test_lm_eval_cli_on_the_committed_decoder(tmp_path):
    """The literal command of docs/studies.md on the committed export (its weights restored as
    weights.json says); its accuracy on the first 20 held-out pairs equals the trainer's check
    (which counts far above chance for a trained model)."""
    decoder = _committed_decoder(tmp_path)
    exe = Path(sys.executable).with_name("lm_eval")
    args = [str(exe) if exe.exists() else "lm_eval", "--model", "lcx", "--model_args",
            f"pretrained={decoder}", "--tasks", "modadd_shift", "--limit", "20",
            "--output_path", str(tmp_path / "out")]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
           "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (path,) = (tmp_path / "out").glob("**/results_*.json")
    res = json.loads(path.read_text())["results"]
    import lcx

    model, _ = lcx.load_model(str(decoder))
    pairs = modadd.split_pairs(0).test[:20]
    want = decoder_accuracy(model, [modadd.render(a, b) for a, b in pairs], [modadd.answer(a, b) for a, b in pairs])
    assert res["modadd_shift_id"]["exact_match,none"] == pytest.approx(want)
    assert want > 0.5


def test_sinusoidal_position_init_has_relative_structure():
    from studies.modadd.model import sinusoidal_table

    t = sinusoidal_table(64, 8).double()  # [P, D]: pairs (sin, cos) per frequency
    assert t.pow(2).mean().sqrt().item() == pytest.approx(0.02, rel=1e-6)
    pairs = t.view(64, 4, 2)
    # shifting by k positions is one fixed rotation per frequency, the same at every position
    for k in (1, 5):
        for f in range(4):
            a, b = pairs[:-k, f], pairs[k:, f]  # [P - k, 2]
            rot = torch.linalg.lstsq(a, b).solution
            torch.testing.assert_close(a @ rot, b, atol=1e-7, rtol=0)  # float32 table, entries ~0.02
    model = ModAddEncoder(EncoderConfig(position_init="sinusoidal", max_positions=64, d_model=8, n_heads=2))
    torch.testing.assert_close(model.pe.table.weight.detach().double(), t.double(), atol=1e-7, rtol=0)
    assert model.pe.table.weight.requires_grad  # still a learned table
    with pytest.raises(ValueError, match="position_init"):
        EncoderConfig(position_init="fixed")


def test_place_value_errors_classifies_wrong_answers():
    pairs = [(12, 34), (57, 8), (90, 90), (3, 4)]
    truth = [(a + b) % 97 for a, b in pairs]
    assert place_value_errors(pairs, truth) == {"errors": 0, "share": None, "reversed": None,
                                                   "chance": len(PLACE_VALUE_SHIFTS) / 96}
    # 21 + 34 (a's digits reversed), 57 + 8 + 9 (one digit at the wrong place: 9k), off by 1 and by 3
    # (2 would count: 99 = 9 x 11 = 2 mod 97)
    pred = [(21 + 34) % 97, (57 + 8 + 9) % 97, (180 + 1) % 97, 10]
    r = place_value_errors(pairs, pred)
    assert r["errors"] == 4 and r["share"] == 0.5 and r["reversed"] == 0.25
    assert 0.3 < r["chance"] < 0.45  # 36 of the 96 wrong classes
    assert all((9 * k) % 97 in PLACE_VALUE_SHIFTS for k in (1, -1, 18, -18))
    assert 0 not in PLACE_VALUE_SHIFTS and 1 not in PLACE_VALUE_SHIFTS


def test_position_decay_false_exempts_only_the_position_table():
    for position_decay in (True, False):
        cfg = RunConfig(recipe="robust", position_decay=position_decay)
        model = build_model(cfg)
        opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.position_decay)
        decayed = {id(p) for p in opt.param_groups[0]["params"]}
        assert opt.param_groups[0]["weight_decay"] == 1.0 and opt.param_groups[1]["weight_decay"] == 0.0
        assert (id(model.pe.table.weight) in decayed) == position_decay
        assert id(model.tok.weight) in decayed and id(model.head.weight) in decayed
    # no table to exempt: a no-op
    cfg = RunConfig(recipe="robust", position="rope", position_decay=False)
    model = build_model(cfg)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.position_decay)
    assert all(p.dim() < 2 for p in opt.param_groups[1]["params"])
    with pytest.raises(ValueError, match="position_decay"):
        RunConfig(position_decay="no")


def test_mask_characters_masks_only_non_digit_text_at_the_rate():
    ids, lengths = pack([modadd.render(53, 7, "What is {a}+{b} mod 97? Answer:", 3), modadd.render(1, 2)])
    masked, which = mask_characters(ids, lengths, 1.0, torch.Generator().manual_seed(0))
    digits = torch.isin(ids, DIGIT_IDS)
    text = (torch.arange(ids.shape[1])[None] < lengths[:, None]) & (torch.arange(ids.shape[1])[None] > 0)
    # rate 1: every non-digit text character, nothing else ([CLS], padding and digits kept)
    assert torch.equal(which, text & ~digits)
    assert torch.equal(masked[which], torch.full((int(which.sum()),), MASK_ID))
    assert torch.equal(masked[~which], ids[~which])
    assert MASK_ID not in ids.tolist()[0] + ids.tolist()[1]
    # a rate in between: a share near it, and a function of the generator's seed alone
    big, blen = pack([modadd.render(a, b, "The sum of {a} and {b} mod 97 equals", 5) for a, b in [(12, 34)] * 200])
    _, w1 = mask_characters(big, blen, 0.15, torch.Generator().manual_seed(1))
    _, w2 = mask_characters(big, blen, 0.15, torch.Generator().manual_seed(1))
    cand = int(((torch.arange(big.shape[1])[None] < blen[:, None]) & ~torch.isin(big, DIGIT_IDS)).sum()) - 200
    assert torch.equal(w1, w2) and 0.12 < int(w1.sum()) / cand < 0.18


def test_mlm_weight_adds_the_token_head_and_its_loss():
    cfg = RunConfig.from_dict({**TINY_RUN, "recipe": "robust_nl", "mlm_weight": 0.5})
    assert cfg.model.token_head and not RunConfig.from_dict({**TINY_RUN}).model.token_head
    model = build_model(cfg)
    batch = batch_at(cfg, modadd.split_pairs(0).train, 2)
    loss, parts = loss_fn(model, cfg, *batch, step=2)
    assert set(parts) == {"ce", "kl", "mlm"}
    assert loss.item() == pytest.approx(parts["ce"] + parts["kl"] + 0.5 * parts["mlm"], rel=1e-5)
    assert parts["mlm"] > 4  # untrained: near ln(vocab)
    loss.backward()
    assert model.token_head.weight.grad.abs().sum() > 0
    # the classifier alone is unchanged by the head: same logits as a model without it
    plain = ModAddEncoder(dataclasses.replace(cfg.model, token_head=False))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("token_head")})
    ids, lengths = batch[0], batch[1]
    torch.testing.assert_close(model(ids, lengths), plain(ids, lengths))
    logits, tok = model(ids, lengths, tokens=True)
    torch.testing.assert_close(logits, plain(ids, lengths), rtol=1e-5, atol=1e-6)
    assert tok.shape == (*ids.shape, cfg.model.vocab_size)
    with pytest.raises(ValueError, match="token_head"):
        plain(ids, lengths, tokens=True)
    for bad in ({"mlm_weight": -1.0}, {"mlm_rate": 0.0}, {"mlm_rate": 1.5}, {"mlm_weight": float("nan")}):
        with pytest.raises(ValueError, match="mlm_"):
            RunConfig.from_dict(bad)
