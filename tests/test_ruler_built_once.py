"""RULER's generated prompts are built once per process (`lcx.report.ruler.built_once`): a second
build of the same tasks hands back the same prompts, leaves the global generators where a real
build leaves them, and does not run the generators again."""

import random

import pytest

from lcx.report import ruler as R

TASKS = ("niah_single_1", "ruler_vt")


def _prompts(tasks):
    return {k: list(t.dataset["test"]["input"]) for k, t in tasks.items()}


@pytest.mark.slow  # two RULER builds at 1024 tokens (~10-20 s)
def test_second_build_is_the_first(monkeypatch):
    R._BUILT.clear()
    _, _, first = R.load_ruler_tasks("tiny-ret-5m", 1024, TASKS)
    after_first = random.random()
    calls = []
    from lm_eval.api.task import ConfigurableTask

    real = ConfigurableTask.download  # what built_once calls on a miss
    monkeypatch.setattr(ConfigurableTask, "download", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    _, _, second = R.load_ruler_tasks("tiny-ret-5m", 1024, TASKS)
    after_second = random.random()
    assert _prompts(second) == _prompts(first) and after_second == after_first
    assert not calls  # served from the process's datasets
    R._BUILT.clear()  # a real build again (counted: the check above can fail): the same prompts, the same generator state after it
    _, _, third = R.load_ruler_tasks("tiny-ret-5m", 1024, TASKS)
    assert len(calls) == len(TASKS)
    assert _prompts(third) == _prompts(first) and random.random() == after_first


@pytest.mark.slow
def test_other_generator_state_builds_again():
    R._BUILT.clear()
    _, _, a = R.load_ruler_tasks("tiny-ret-5m", 1024, ("niah_single_1",))
    n = len(R._BUILT)
    with R.built_once():  # the state differs from seed_as_lm_eval's: not the same prompts, built anew
        from lm_eval.tasks import TaskManager
        import lm_eval.tasks

        from pathlib import Path

        random.seed(12345)
        tm = TaskManager(metadata={"tokenizer": "tiny-ret-5m", "max_seq_lengths": [1024]},
                         include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"), include_defaults=False)
        b = tm.load(["niah_single_1"])["tasks"]
    assert len(R._BUILT) == n + 1
    assert _prompts(b) != _prompts(a)
