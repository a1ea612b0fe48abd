#!/usr/bin/env bash
# Install one trainer library, at the version treadle's adapter is tested against,
# into a virtualenv of its own (.venv-<name> in the repo) with treadle itself
# (editable), for the adapters' integration tests (tests/trainers/). Each trainer
# gets its own because their pins conflict (verl and SkyRL want older transformers
# than vLLM's CPU build). Usage: scripts/trainer-venv.sh trl|verl|skyrl. Idempotent
# (a stamp per pinned version); pip only, for the local CPU torch==2.13.0 wheel.
# Prints the virtualenv's python path.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
name="${1:?usage: scripts/trainer-venv.sh trl|verl|skyrl}"
case "$name" in
    trl|verl|skyrl) ;;
    *) echo "treadle: no trainer adapter named $name (trl, verl, skyrl)" >&2; exit 2 ;;
esac
venv="$repo/.venv-$name"
py="${PYTHON:-python3}"
# The extra's pins are the stamp: a changed pin reinstalls.
pins="$(sed -n "/^$name = \[/,/^\]/p" pyproject.toml | sha256sum | cut -c1-12)"
stamp="$venv/.treadle-$name-$pins"
if [ ! -f "$stamp" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        echo "treadle: creating virtualenv at $venv" >&2
        "$py" -m venv "$venv"
    fi
    echo "treadle: installing treadle[$name] into $venv (a few minutes, once)" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q torch==2.13.0 -e ".[$name]"
    "$venv/bin/python" -c "import $name, treadle" >&2
    touch "$stamp"
fi
echo "$venv/bin/python"
