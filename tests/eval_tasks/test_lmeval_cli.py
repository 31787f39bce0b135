"""The literal `lm_eval` command line with lcx's tasks and model, and the start-up hook behind it.

The hook lives in `lcx-lmeval-hook.pth`, which setup.py writes into site-packages for regular
and editable installs; these tests run fresh interpreters so the `.pth` file is what acts.
Each CLI run is kept short (tiny random model, `--limit 2`): most of its time is lm-eval's start-up.
"""

from __future__ import annotations

import ast
import base64
import glob
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lcx.eval_tasks import TASKS_DIR  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PTH_NAME = "lcx-lmeval-hook.pth"
LENGTHS = [300, 512]  # byte tokenizer: the passkey scaffold alone is ~260 tokens
LIBRA = os.path.join("lm_eval", "tasks", "libra", "passkey.yaml")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LCX_NO_LMEVAL_HOOK"}
    # (OMP_NUM_THREADS: the tests' one thread, tests/conftest.py)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _run(args: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, env=_env(**env), cwd="/", timeout=timeout)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _python(code: str, **env: str) -> str:
    return _run([sys.executable, "-c", code], **env).stdout


def _pth_line() -> str:
    """PTH_LINE as setup.py defines it (setup.py runs setup() on import, so parse it)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PTH_LINE":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no PTH_LINE")


# --------------------------------------------------------------------------- the hook
def test_pth_file_is_installed():
    import site

    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = [Path(d, PTH_NAME) for d in site_dirs if Path(d, PTH_NAME).is_file()]
    assert found, f"{PTH_NAME} is not in {site_dirs}: run scripts/setup.sh (pip install -e '.[dev]')"
    assert found[0].read_text() == _pth_line()


HOOK_PROBE = """
import sys, json
from lm_eval.tasks import TaskManager
tm = TaskManager()
entry = tm.task_index["passkey"]
lazy = "lcx.lmeval_model" not in sys.modules
from lm_eval.api.registry import get_model
out = {"passkey": str(entry.yaml_path), "lazy": lazy}
out["hf"] = get_model("hf").__name__
try:
    out["lcx"] = get_model("lcx").__module__
except ValueError:
    out["lcx"] = None
out["pending"] = sorted(p for f in sys.meta_path if type(f).__name__ == "_Finder" for p in f.pending)
out["tasks"] = sorted(n for n in ("passkey_ll", "modadd_shift", "lcx_ppl") if n in tm.all_tasks)
print(json.dumps(out))
"""


def test_hook_registers_lcx_model_and_tasks_lazily():
    out = json.loads(_python(HOOK_PROBE).strip().splitlines()[-1])
    assert Path(out["passkey"]).parent.parent == TASKS_DIR, "lcx's passkey must replace LIBRA's"
    assert out["tasks"] == ["lcx_ppl", "modadd_shift", "passkey_ll"]
    assert out["lazy"], "building the task index must not import the lcx model (torch)"
    assert out["lcx"] == "lcx.lmeval_model" and out["hf"] == "HFLM"
    # the finder waits only for RULER's module (patched when a RULER task is loaded; test_ruler.py)
    assert out["pending"] == ["lm_eval.tasks.ruler.common_utils"]


APPLY_PROBE = """
import lcx._lmeval_hook as h
from lm_eval.api.registry import get_model
assert h.apply(force=True)
cls = get_model("local-completions")
print(cls.__name__, getattr(cls.__init__, h._LENGTH_PATCHED_ATTR, False), get_model("lcx").__module__)
"""


@pytest.mark.parametrize("hook", ["on", pytest.param("off", marks=pytest.mark.slow)])
def test_explicit_apply_patches_local_completions_with_or_without_the_hook(hook):
    """`apply()` (what `python -m lcx.eval_tasks` runs) works whether or not the start-up hook
    already routed the lazy `local-completions` entry (it raised 'already registered' when it had)."""
    env = {"LCX_NO_LMEVAL_HOOK": "1"} if hook == "off" else {}
    out = _python(APPLY_PROBE, **env).strip().splitlines()[-1]
    assert out == "LocalCompletionsAPI True lcx.lmeval_model"


@pytest.mark.slow
def test_hook_opt_out():
    out = json.loads(_python(HOOK_PROBE, LCX_NO_LMEVAL_HOOK="1").strip().splitlines()[-1])
    assert out["passkey"].endswith(LIBRA) and out["lcx"] is None and out["tasks"] == []


@pytest.mark.slow
def test_hook_skips_other_lm_eval_versions():
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import lm_eval; lm_eval.__version__ = '0.4.99'\n"
        "from lm_eval.tasks import TaskManager\n"
        "print(TaskManager().task_index['passkey'].yaml_path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd="/",
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith(LIBRA)
    assert "lm-eval 0.4.99 is installed but lcx's lm-eval hook patches 0.4.13" in out.stderr


@pytest.mark.slow
def test_explicit_include_path_is_not_indexed_twice():
    code = (
        "from lm_eval.tasks import TaskManager\n"
        f"tm = TaskManager(include_path={str(TASKS_DIR)!r})\n"
        "print(tm.include_path)\n"
    )
    assert _python(code).strip() == str(TASKS_DIR)


# --------------------------------------------------------------------------- wheels
def _check_wheel(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    assert zf.read(PTH_NAME).decode() == _pth_line()
    record = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    data = zf.read(PTH_NAME)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert f"{PTH_NAME},sha256={digest},{len(data)}" in record.splitlines()
    assert zf.testzip() is None


@pytest.mark.slow
def test_regular_wheel_ships_the_pth_file_and_task_files(tmp_path):
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
          str(ROOT)], timeout=300, PIP_DISABLE_PIP_VERSION_CHECK="1")
    (wheel,) = tmp_path.glob("lcx-*.whl")
    _check_wheel(wheel)
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("lcx/eval_tasks/") and not n.endswith(".py")}
    here = {"lcx/eval_tasks/" + str(p.relative_to(TASKS_DIR)) for p in TASKS_DIR.rglob("*")
            if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts}
    assert here <= shipped, f"task files missing from the wheel: {sorted(here - shipped)}"


@pytest.mark.slow
def test_editable_wheel_ships_the_pth_file(tmp_path):
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = tmp_path / out.stdout.strip().splitlines()[-1]
    _check_wheel(wheel)
    assert any(n.startswith("__editable__") for n in zipfile.ZipFile(wheel).namelist())


# --------------------------------------------------------------------------- the literal CLI
def _results(out_dir: Path) -> dict:
    (path,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())


def _lm_eval() -> str:
    exe = Path(sys.executable).with_name("lm_eval")
    return str(exe) if exe.exists() else "lm_eval"


def _cli(model: str, model_args: str, tasks: str, out_dir: Path, prefix: list[str] | None = None, **env) -> dict:
    args = (prefix or [_lm_eval()]) + [
        "--model", model, "--model_args", model_args, "--tasks", tasks, "--limit", "2",
        "--metadata", json.dumps({"max_seq_lengths": LENGTHS}), "--output_path", str(out_dir)]
    _run(args, **env)
    return _results(out_dir)


def _keys(res: dict, task: str) -> set[str]:
    return {k.split(",")[0] for k in res["results"][task] if k.endswith(",none") and "_stderr" not in k}


@pytest.mark.slow
def test_cli_hf_model(tiny_model_dir, tmp_path):
    res = _cli("hf", f"pretrained={tiny_model_dir}", "modadd_shift,passkey", tmp_path)
    assert _keys(res, "passkey") == {str(L) for L in LENGTHS}
    assert _keys(res, "modadd_shift") == {"exact_match"}
    assert {"modadd_shift_id", "modadd_shift_pos", "modadd_shift_template"} <= set(res["results"])
    assert res["n-samples"]["passkey"]["effective"] == 2


@pytest.mark.slow  # lm_eval's CLI end to end: ~16 s (#76 item 7)
def test_cli_lcx_model_with_yarn(tiny_model_dir, tmp_path):
    res = _cli("lcx", f"pretrained={tiny_model_dir},rope_type=yarn,factor=4", "modadd_shift,passkey,lcx_ppl",
               tmp_path)
    assert _keys(res, "passkey") == {str(L) for L in LENGTHS}
    ppl = res["results"]["lcx_ppl"]
    for L in LENGTHS:
        assert 0 < ppl[f"bits_per_byte_{L},none"] < 20
    assert res["config"]["model"] == "lcx"
    assert res["config"]["model_args"]["rope_type"] == "yarn"


@pytest.mark.slow
def test_cli_module_entry_point_without_the_hook(tiny_model_dir, tmp_path):
    res = _cli("lcx", f"pretrained={tiny_model_dir},rope_type=dynamic,factor=4", "passkey_ll", tmp_path,
               prefix=[sys.executable, "-m", "lcx.eval_tasks"], LCX_NO_LMEVAL_HOOK="1")
    assert _keys(res, "passkey_ll") == {str(L) for L in LENGTHS}
