"""Start-up hook that makes lm-eval see lcx: the `lcx` model and the tasks in `lcx.eval_tasks`.

lm-eval 0.4.13 has no plugin mechanism: a model is found only if its module was imported before
lm-eval looks it up, and tasks outside lm-eval load only through `include_path`. So lcx ships a
`.pth` file (`lcx-lmeval-hook.pth`, written into site-packages by setup.py for regular and
editable installs) whose one line runs `install()` when Python starts. `install()` imports
nothing heavy: it puts a finder at the front of `sys.meta_path` that waits for three modules and
patches each right after it executes:

- `lm_eval.models` (the package that fills lm-eval's model registry): registers `lcx` as a lazy
  entry `"lcx.lmeval_model:LcxLM"`, so `lcx.lmeval_model` (and torch) load only when
  `--model lcx` is asked for.
- `lm_eval.tasks.manager`: wraps `TaskManager.__init__` so the lcx task folder is an include
  path, after lm-eval's own tasks and before the user's `--include_path`. Later paths win in
  lm-eval's index, so lcx's `passkey` replaces lm-eval's LIBRA `passkey` (Russian, from the
  hub); a user's own folder still overrides lcx.
  It also points the registry's lazy `local-completions` entry at this module's
  `LocalCompletionsAPI`, which imports lm-eval's class when first asked for and patches it
  (`patch_local_completions`): `local-completions` left-truncates every prompt to `max_length`
  - 1 tokens, 2,047 by default, with only a log line, so a "4096" passkey measured through a
  server would silently score ~2,035-token prompts. When `max_length` is not in `--model_args`,
  the patched class asks the server (`GET /v1/models`: lcx's and vLLM's cards carry
  `max_model_len`) and uses its `max_model_len` (`server_max_model_len`); and a request longer
  than `max_length` raises `lcx.truncation.PromptTooLongError` (the task, its tokens, the
  limit, the flag that raises it) instead of being cut, unless `allow_truncation=true`.
- `lm_eval.tasks.ruler.common_utils` (imported by every RULER task before it builds data): wraps
  `get_tokenizer` so RULER sizes its prompts with the tokenizer `lcx.load_model` gives the model
  named in `--model_args pretrained=...` (a preset, a local HF directory, a `.gguf`) instead of
  asking `AutoTokenizer` for that name; and appends lcx's parameter-free Punkt sentence splitter
  (`eval_tasks/ruler_pd/nltk_data`) to nltk's data path, so RULER's import finds `punkt_tab`
  instead of trying to download it (an installed English `punkt_tab` still wins; docs/lm-eval.md).

The finder removes itself once all three modules are patched (the RULER one only when RULER is used).
Nothing happens when `LCX_NO_LMEVAL_HOOK=1`, when lm-eval is never imported, or (with one warning) when the installed
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
RULER_COMMON = "lm_eval.tasks.ruler.common_utils"
_PATCHED_ATTR = "_lcx_include_path_patched"
_LENGTH_PATCHED_ATTR = "_lcx_max_length_patched"
LM_EVAL_DEFAULT_MAX_LENGTH = 2048  # lm-eval's TemplateAPI default (prompts cut to this - 1 tokens)

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


LOCAL_COMPLETIONS = "local-completions"
LOCAL_COMPLETIONS_TARGET = "lm_eval.models.openai_completions:LocalCompletionsAPI"  # lm-eval's lazy entry


def register_model(models_module=None) -> None:
    """Register `lcx` in lm-eval's model registry as a lazy "module:Class" entry, and route the
    lazy `local-completions` entry through `LocalCompletionsAPI` here (patched on first use)."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)
    objs = getattr(model_registry, "_objs", None)  # lm-eval 0.4.13's store (the version this patches)
    if isinstance(objs, dict) and objs.get(LOCAL_COMPLETIONS) == LOCAL_COMPLETIONS_TARGET:
        objs[LOCAL_COMPLETIONS] = f"{__name__}:LocalCompletionsAPI"


def _unroute_local_completions() -> None:
    """Give the lazy `local-completions` entry back to lm-eval before its module is imported:
    that module registers its class under the name and refuses an entry it did not write."""
    from lm_eval.api.registry import model_registry

    objs = getattr(model_registry, "_objs", None)
    if isinstance(objs, dict) and objs.get(LOCAL_COMPLETIONS) == f"{__name__}:LocalCompletionsAPI":
        objs[LOCAL_COMPLETIONS] = LOCAL_COMPLETIONS_TARGET


def __getattr__(name: str):
    """`LocalCompletionsAPI`: lm-eval's class, patched (`patch_local_completions`); imported only
    when lm-eval's registry materialises `local-completions`."""
    if name == "LocalCompletionsAPI":
        _unroute_local_completions()
        import lm_eval.models.openai_completions as module

        patch_local_completions(module)
        return module.LocalCompletionsAPI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    _patch_yaml_loader()


def _patch_yaml_loader() -> None:
    """lm-eval's YAML loader executes a `!function` module's file afresh (`common_utils.py` for
    RULER's `process_results`) and puts the new module in `sys.modules`, so RULER modules imported
    after it would see an unpatched `get_tokenizer`: patch every fresh copy too."""
    import lm_eval.tasks._yaml_loader as loader

    original = loader._load_module_with_cache
    if getattr(original, _PATCHED_ATTR, False):
        return

    def _load_module_with_cache(module_path):
        module = original(module_path)
        if getattr(module, "__name__", None) == RULER_COMMON:
            patch_ruler(module)
        return module

    setattr(_load_module_with_cache, _PATCHED_ATTR, True)
    loader._load_module_with_cache = _load_module_with_cache


def lcx_tokenizer_dir(name: str) -> str | None:
    """The directory of the tokenizer `lcx.load_model(name)` returns, or None when `name` is not
    something lcx loads (left to `AutoTokenizer`). A Hub id `org/name[@revision]` is its snapshot in
    the Hugging Face cache (config and tokenizer files suffice: `lcx.models.hub`). A `.gguf` is
    dequantized into lcx's cache first if needed (the `lcx` model has normally done it already). A
    preset whose files are missing, or a Hub id not cached while offline, raises
    `FileNotFoundError` saying how to get them."""
    from lcx.models import gguf_cache_dir, is_gguf_cached, load_model, resolve_source

    try:
        kind, path = resolve_source(name, weights=False)
    except ValueError:
        return None
    if kind == "gguf":
        if not is_gguf_cached(path):
            load_model(path)  # builds the cache entry (model + tokenizer files)
        return str(gguf_cache_dir(path))
    return str(path)


def nltk_data_dir() -> str:
    """lcx's nltk data: `tokenizers/punkt_tab/english` with empty Punkt parameters (Punkt's rules
    without learned abbreviations), since nltk's English parameters are a download."""
    return os.path.join(tasks_dir(), "ruler_pd", "nltk_data")


def patch_ruler(common_utils=None) -> None:
    """Make lm-eval's RULER tasks run offline on lcx models (see the module docstring)."""
    import functools

    if common_utils is None:
        import lm_eval.tasks.ruler.common_utils as common_utils
    original = common_utils.get_tokenizer
    if getattr(original, _PATCHED_ATTR, False):
        return
    import nltk

    if nltk_data_dir() not in nltk.data.path:
        nltk.data.path.append(nltk_data_dir())

    @functools.cache
    def get_tokenizer(tokenizer=None, pretrained=None, **kwargs):
        name = tokenizer or pretrained
        local = lcx_tokenizer_dir(name) if isinstance(name, str) and name else None
        return original(local or name, **kwargs)

    get_tokenizer.__wrapped__ = original
    setattr(get_tokenizer, _PATCHED_ATTR, True)
    common_utils.get_tokenizer = get_tokenizer


def server_max_model_len(base_url: str | None, auth_token: str | None = None, timeout: float = 10.0) -> int | None:
    """The `max_model_len` the OpenAI-compatible server at `base_url` (lm-eval's, e.g.
    http://HOST:PORT/v1/completions) states in `GET /v1/models`, or None when it does not answer
    or does not say. The key: `auth_token`, else $OPENAI_API_KEY (what lm-eval sends)."""
    import json
    import urllib.request

    if not base_url:
        return None
    root = base_url.replace("/v1/completions", "").replace("/v1/chat/completions", "").rstrip("/")
    key = auth_token or os.environ.get("OPENAI_API_KEY")
    req = urllib.request.Request(f"{root}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read().decode("utf-8"))
        n = data["data"][0]["max_model_len"]
    except Exception:  # noqa: BLE001 - any server, any failure: the caller warns
        return None
    return int(n) if isinstance(n, int) and n > 1 else None


def patch_local_completions(module=None) -> None:
    """Make `local-completions` measure the length its task asks for (`lcx.truncation`):

    - `max_length` not in `--model_args`: use the server's `max_model_len` (lm-eval's default
      would cut every prompt to 2,047 tokens), or warn when the server does not say;
    - a request longer than `max_length` (a generation prompt with its `max_gen_toks`, a
      log-likelihood request, a rolling document) raises `PromptTooLongError` naming the task,
      the tokens, the limit and the flag that raises it, where lm-eval would left-truncate it and
      exit 0; `allow_truncation=true` in `--model_args` restores lm-eval's cut.

    Without a client-side tokenizer (`tokenizer_backend=None`) lm-eval sends text and cannot
    cut: the server refuses a prompt over its limit with a 400 that lm-eval raises."""
    import functools

    if module is None:
        import lm_eval.models.openai_completions as module
    cls = module.LocalCompletionsAPI
    if getattr(cls.__init__, _LENGTH_PATCHED_ATTR, False):
        return
    from lcx import truncation

    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        allow = truncation.allow_truncation(kwargs.pop(truncation.ALLOW_KEY, False))
        source = "max_length in --model_args"
        if type(self) is cls and kwargs.get("max_length") is None:  # not OpenAI's own API (a subclass)
            n = server_max_model_len(kwargs.get("base_url"), kwargs.get("auth_token"))
            if n is not None:
                kwargs["max_length"] = n
                source = f"the server's max_model_len, GET /v1/models at {kwargs.get('base_url')}"
                print(f"lcx: local-completions max_length={n}, the server's max_model_len (GET /v1/models); "
                      "pass max_length= in --model_args to choose another", file=sys.stderr)
            else:
                source = "lm-eval's default: the server does not state its max_model_len"
                warnings.warn(
                    f"lcx: max_length is not in --model_args and the server at {kwargs.get('base_url')} does not "
                    f"state its max_model_len: lm-eval's default max_length {LM_EVAL_DEFAULT_MAX_LENGTH} applies, "
                    f"and lcx refuses longer prompts; pass max_length=<the server's limit>",
                    RuntimeWarning, stacklevel=2)
        original(self, *args, **kwargs)
        self._lcx_allow_truncation = allow
        # TemplateAPI keeps max_length - 1 (one token for generation): the limit its cuts use
        self._lcx_where = {
            "limit_source": f"{source}, less the one token lm-eval keeps for generation",
            "raise_with": "`lcx serve --max-model-len N` or vLLM's `--max-model-len N`, and max_length=N "
                          "in --model_args"}

    def checking(self) -> bool:
        return type(self) is cls and not getattr(self, "_lcx_allow_truncation", True)

    generate_until = cls.generate_until

    @functools.wraps(generate_until)
    def _generate_until(self, requests, disable_tqdm: bool = False):
        if checking(self) and self.tokenized_requests and requests:
            contexts = [r.args[0] for r in requests]
            encoded = self.tok_encode(contexts, add_special_tokens=self.add_bos_token)
            budgets = [int(r.args[1].get("max_gen_toks", self._max_gen_toks)) for r in requests]
            truncation.check_generation(requests, encoded, budgets, self.max_length, **self._lcx_where)
        return generate_until(self, requests, disable_tqdm=disable_tqdm)

    loglikelihood = cls.loglikelihood

    @functools.wraps(loglikelihood)
    def _loglikelihood(self, requests, disable_tqdm: bool = False):
        self._lcx_tasks = truncation.task_names(requests)
        return loglikelihood(self, requests, disable_tqdm=disable_tqdm)

    batch = cls.batch_loglikelihood_requests

    @functools.wraps(batch)
    def _batch_loglikelihood_requests(self, chunks):
        chunks = [list(c) for c in chunks]
        if checking(self):
            truncation.check_loglikelihood((r for c in chunks for r in c), self.max_length,
                                           tasks=getattr(self, "_lcx_tasks", "(task not named)"), **self._lcx_where)
        return batch(self, chunks)

    rolling = cls.loglikelihood_rolling

    @functools.wraps(rolling)
    def _loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if checking(self) and requests:
            # lm-eval's windows hold max_length - 1 tokens (one for the context token)
            truncation.check_rolling((len(self.tok_encode(r.args[0])) for r in requests), self.max_length - 1,
                                     tasks=truncation.task_names(requests), **self._lcx_where)
        return rolling(self, requests, disable_tqdm=disable_tqdm)

    setattr(__init__, _LENGTH_PATCHED_ATTR, True)
    cls.__init__ = __init__
    cls.generate_until = _generate_until
    cls.loglikelihood = _loglikelihood
    cls.batch_loglikelihood_requests = _batch_loglikelihood_requests
    cls.loglikelihood_rolling = _loglikelihood_rolling


def apply(force: bool = False) -> bool:
    """Patch lm-eval now (importing it). On an unsupported version: warn and return False, or
    with `force=True` patch anyway (what `python -m lcx.eval_tasks` does)."""
    import lm_eval  # noqa: F401

    if not _version_ok() and not force:
        return False
    import lm_eval.models

    _unroute_local_completions()  # the start-up hook may have routed it when lm_eval.models loaded
    import lm_eval.models.openai_completions
    import lm_eval.tasks.manager

    register_model(lm_eval.models)
    patch_task_manager(lm_eval.tasks.manager)
    patch_local_completions(lm_eval.models.openai_completions)
    import lm_eval.tasks.ruler.common_utils

    patch_ruler(lm_eval.tasks.ruler.common_utils)
    return True


# ------------------------------------------------------------------------------ the import hook
_CALLBACKS = {"lm_eval.models": register_model, "lm_eval.tasks.manager": patch_task_manager,
              RULER_COMMON: patch_ruler}


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
