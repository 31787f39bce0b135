"""Start-up hook that makes lm-eval see lcx: the `lcx` model and the tasks in `lcx.eval_tasks`.

lm-eval 0.4.13 has no plugin mechanism: a model is found only if its module was imported before
lm-eval looks it up, and tasks outside lm-eval load only through `include_path`. So lcx ships a
`.pth` file (`lcx-lmeval-hook.pth`, written into site-packages by setup.py for regular and
editable installs) whose one line runs `install()` when Python starts. `install()` imports
nothing heavy: it puts a finder at the front of `sys.meta_path` that waits for two modules and
patches each right after it executes:

- `lm_eval.models` (the package that fills lm-eval's model registry): registers `lcx` as a lazy
  entry `"lcx.lmeval_model:LcxLM"`, so `lcx.lmeval_model` (and torch) load only when
  `--model lcx` is asked for.
- `lm_eval.tasks.manager`: wraps `TaskManager.__init__` so the lcx task folder is an include
  path, after lm-eval's own tasks and before the user's `--include_path`. Later paths win in
  lm-eval's index, so lcx's `passkey` replaces lm-eval's LIBRA `passkey` (Russian, from the
  hub); a user's own folder still overrides lcx.

The finder removes itself once both modules are patched. Nothing happens when
`LCX_NO_LMEVAL_HOOK=1`, when lm-eval is never imported, or (with one warning) when the installed
lm-eval is not `SUPPORTED_LM_EVAL`, the version whose internals this patches. Failures inside
the hook are turned into warnings: they must never break an unrelated Python process.

Explicit alternatives (no hook): `lm_eval --include_path <lcx.eval_tasks.TASKS_DIR> ...` for the
tasks with any lm-eval model, and `python -m lcx.eval_tasks ...` (same arguments as `lm_eval`)
for the tasks and the `lcx` model; `apply()` is what both the hook and that entry point run.
"""

from __future__ import annotations

import os
import sys
import warnings

SUPPORTED_LM_EVAL = "0.4.13"
OPT_OUT_ENV = "LCX_NO_LMEVAL_HOOK"
MODEL_NAME = "lcx"
MODEL_TARGET = "lcx.lmeval_model:LcxLM"
_PATCHED_ATTR = "_lcx_include_path_patched"

_warned = False


def enabled() -> bool:
    return os.environ.get(OPT_OUT_ENV, "").strip() not in ("1", "true", "yes")


def tasks_dir() -> str:
    """Where lcx's task YAMLs are, without importing lcx.eval_tasks' dependencies."""
    import importlib.util

    spec = importlib.util.find_spec("lcx.eval_tasks")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lcx.eval_tasks is not importable")
    return os.path.realpath(list(spec.submodule_search_locations)[0])


# ------------------------------------------------------------------------------ the patches
def _version_ok() -> bool:
    global _warned
    version = getattr(sys.modules.get("lm_eval"), "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("lm_eval")
    if version == SUPPORTED_LM_EVAL:
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"lcx: lm-eval {version} is installed but lcx's lm-eval hook patches {SUPPORTED_LM_EVAL}; "
            f"the `lcx` model and lcx tasks are not registered. Use `python -m lcx.eval_tasks` or "
            f"`--include_path {tasks_dir()}`, or install lm-eval=={SUPPORTED_LM_EVAL}.",
            RuntimeWarning, stacklevel=2)
    return False


def register_model(models_module=None) -> None:
    """Register `lcx` in lm-eval's model registry as a lazy "module:Class" entry."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def patch_task_manager(manager_module=None) -> None:
    """Make every `TaskManager` also index lcx's tasks (after lm-eval's, before the user's)."""
    import functools
    import inspect

    if manager_module is None:
        import lm_eval.tasks.manager as manager_module
    cls = manager_module.TaskManager
    if getattr(cls.__init__, _PATCHED_ATTR, False):
        return
    original = cls.__init__
    signature = inspect.signature(original)
    ours = tasks_dir()

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments.get("include_path")
        paths = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
        if all(os.path.realpath(str(p)) != ours for p in paths):
            bound.arguments["include_path"] = [ours, *paths]
        original(*bound.args, **bound.kwargs)

    setattr(__init__, _PATCHED_ATTR, True)
    cls.__init__ = __init__


def apply(force: bool = False) -> bool:
    """Patch lm-eval now (importing it). On an unsupported version: warn and return False, or
    with `force=True` patch anyway (what `python -m lcx.eval_tasks` does)."""
    import lm_eval  # noqa: F401

    if not _version_ok() and not force:
        return False
    import lm_eval.models
    import lm_eval.tasks.manager

    register_model(lm_eval.models)
    patch_task_manager(lm_eval.tasks.manager)
    return True


# ------------------------------------------------------------------------------ the import hook
_CALLBACKS = {"lm_eval.models": register_model, "lm_eval.tasks.manager": patch_task_manager}


class _Loader:
    """Wraps a module's loader: runs the real `exec_module`, then the lcx patch."""

    def __init__(self, loader, callback, finder):
        self._loader, self._callback, self._finder = loader, callback, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # hide the wrapper afterwards
        self._finder.done(module.__name__)
        try:
            if _version_ok():
                self._callback(module)
        except Exception as e:  # never break lm-eval itself
            warnings.warn(f"lcx: lm-eval hook failed on {module.__name__}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _Finder:
    """Meta-path finder that intercepts the modules of `_CALLBACKS` and nothing else."""

    def __init__(self):
        self.pending = set(_CALLBACKS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, _CALLBACKS[fullname], self)
                return spec
        return None

    def done(self, fullname):
        self.pending.discard(fullname)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Called by `lcx-lmeval-hook.pth` at interpreter start-up. Cheap; never raises.

    Modules of interest that are already imported (a late, manual call) are patched at once;
    the others are left to the finder, which costs one set lookup per import until then.
    """
    try:
        if not enabled() or any(isinstance(f, _Finder) for f in sys.meta_path):
            return
        finder = _Finder()
        for name in list(finder.pending):
            if name in sys.modules:
                finder.pending.discard(name)
                if _version_ok():
                    _CALLBACKS[name](sys.modules[name])
        if finder.pending:
            sys.meta_path.insert(0, finder)
    except Exception as e:  # pragma: no cover - defensive
        warnings.warn(f"lcx: could not install the lm-eval hook: {type(e).__name__}: {e}", RuntimeWarning)
