"""`lcx.methods.registry`: the one list of attention methods, the examples every test grid over
methods is generated from, and docs/contributing.md's worked example for adding a method (checked
here: the files it lists are the only library files that name the method, and a method registered
without editing any test shows up in every grid the example names)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

import lcx.methods
from lcx.methods import ATTENTION_METHODS, AttentionMethod, examples, method_from_dict, method_id

REPO = Path(lcx.__file__).resolve().parents[1]
LIBRARY = ("lcx", "serve", "kernels", "eval_tasks")  # the code a method may have to be added to
# The example method of docs/contributing.md: what its worked example lists must be the whole change.
EXAMPLE = ATTENTION_METHODS["self_extend"]
# Every test generated from `examples()`: "file::test" -> a test id fragment of the method's cases.
GRIDS = (
    "tests/methods/test_backends.py::test_backend_equals_reference",
    "tests/methods/test_causal_up_to.py::test_method_is_causal_up_to_its_bound",
    "tests/methods/test_last_query.py::test_last_query_equals_attend",
    "tests/methods/test_last_query.py::test_query_keys_reproduce_attend_for_every_query",
    "tests/methods/test_decode_rule.py::test_rule_equals_last_query_keys",
    "tests/methods/test_plan.py::test_plan_equals_attend",
    "tests/kernels/test_relative_attention_cpu.py::test_smoke_equals_attend",
    "tests/engine/test_kv_store.py::test_decode_steps_equal_attend",
    "tests/engine/test_engine_attention.py::test_engine_batch_equals_bounded_cache_rows",
    "tests/methods/test_attention_methods.py::test_bounded_cache_generation_equals_full_cache",
    "tests/hf/test_families.py::test_layers_equal_method_on_the_familys_own_qkv",
)


def _readme_example() -> str:
    text = (REPO / "docs" / "contributing.md").read_text()
    start = text.index("**Worked example: adding an attention method.**")
    return text[start:text.index("\n\n", text.index("Everything else follows from the registry", start))]


# ------------------------------------------------------------------------------ the registry


@pytest.mark.parametrize("name", list(ATTENTION_METHODS))
def test_one_module_per_method(name):
    cls = ATTENTION_METHODS[name]
    assert cls.name == name and issubclass(cls, AttentionMethod)
    assert cls.__module__ == f"lcx.methods.{name}", "a method lives in lcx/methods/<name>.py"
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    # exported by the package with its factory, `<name>(**params)`
    assert getattr(lcx.methods, cls.__name__) is cls
    for params in cls.examples:
        assert getattr(lcx.methods, name)(**params) == cls(**params)


@pytest.mark.parametrize("name", list(ATTENTION_METHODS))
def test_examples_are_valid_and_distinct(name):
    cls = ATTENTION_METHODS[name]
    methods = cls.example_methods()
    assert methods, f"{name} declares no examples: no test grid would run it"
    assert len(set(methods)) == len(methods)
    for m in methods:
        assert method_from_dict(m.to_dict()) == m


def test_examples_are_every_methods_examples_with_distinct_ids():
    got = examples()
    assert [m.name for m in got] == [n for n, cls in ATTENTION_METHODS.items() for _ in cls.examples]
    assert len({method_id(m) for m in got}) == len(got)
    assert method_id(lcx.methods.lm_infinite(2, 4, limit_distance=9)) == "lm_infinite(n_global=2,n_local=4,limit_distance=9)"


# ------------------------------------------------------------------ the worked example (docs/contributing.md)


def _names_in_code(path: Path, names: set[str], literals: set[str]) -> list[int]:
    """Lines of `path` whose code (not comments or docstrings) names one of `names` or has a string
    literal equal to one of `literals`."""
    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        literal = tok.type == tokenize.STRING and re.sub(r"^[rbuf]*(['\"])(.*)\1$", r"\2", tok.string) in literals
        if (tok.type == tokenize.NAME and tok.string in names) or literal:
            lines.append(tok.start[0])
    return lines


def test_worked_example_lists_every_file_that_names_the_method():
    """The worked example (docs/contributing.md) is the whole change: in the library, only the files (and
    folders) it lists name the example method in code."""
    listed = set(re.findall(r"`((?:lcx|serve|kernels|eval_tasks|tests)/[\w/]*(?:\.py|/))`", _readme_example()))
    for p in listed:
        assert (REPO / p).exists(), f"the worked example lists {p}, which does not exist"
    names = {EXAMPLE.__name__, EXAMPLE.name, *(n for n in lcx.methods.registry.__all__
                                               if getattr(getattr(lcx.methods, n), "__module__", None) == EXAMPLE.__module__)}
    naming = {
        str(p.relative_to(REPO))
        for root in LIBRARY
        for p in (REPO / root).rglob("*.py")
        if _names_in_code(p, names, {EXAMPLE.name})
    }
    unlisted = sorted(p for p in naming if p not in listed and not any(p.startswith(d) for d in listed if d.endswith("/")))
    assert not unlisted, f"{EXAMPLE.name} is named in {unlisted}, which the worked example does not list"
    module = f"lcx/methods/{EXAMPLE.name}.py"
    assert module in listed and module in naming
    # "two lines in lcx/methods/registry.py": its import and its entry
    assert len(set(_names_in_code(REPO / "lcx/methods/registry.py", names, set()))) == 2


def test_worked_example_names_every_generated_grid():
    text = _readme_example()
    for grid in GRIDS:
        assert grid.split("::")[0].split("/")[-1] in text, f"the worked example does not name {grid}"


# A method added without touching any test: registered by a pytest plugin before the test modules
# are collected (as a registry line would), with every fast path: a subclass of Sinks, bare (the
# `attention_sinks` mask at true positions, so its keys may be cached rotated).
_PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from typing import ClassVar

    from lcx.methods import registry
    from lcx.methods.sinks import Sinks


    @dataclass(frozen=True)
    class ToySinks(Sinks):
        name: ClassVar[str] = "toy_sinks"
        needs_unrotated_keys: ClassVar[bool] = False
        examples = ({"n_sink": 1, "window": 3, "renumber": False},)


    registry.ATTENTION_METHODS["toy_sinks"] = ToySinks
''')


def _run_with_toy_method(tmp_path, *args) -> subprocess.CompletedProcess:
    (tmp_path / "lcx_toy_plugin.py").write_text(_PLUGIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    files = sorted({g.split("::")[0] for g in GRIDS})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "lcx_toy_plugin", "-q", "-p", "no:cacheprovider",
                           "-k", "toy_sinks", *args, *files], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)


@pytest.mark.slow
def test_a_new_method_is_in_every_grid(tmp_path):
    """Registering a method is all it takes for every generated grid to run it."""
    out = _run_with_toy_method(tmp_path, "--collect-only")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = [line for line in out.stdout.splitlines() if "toy_sinks" in line]
    for grid in GRIDS:
        assert any(line.startswith(grid + "[") for line in collected), f"{grid} has no case of a new method"


@pytest.mark.slow
def test_a_new_method_passes_every_grid(tmp_path):
    """...and they pass for it (a correct method: every fast path equals its `attend`)."""
    out = _run_with_toy_method(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"\b\d+ passed\b", out.stdout) and " failed" not in out.stdout
