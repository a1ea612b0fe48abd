# Sourced by scripts/demo and scripts/test: create or reuse .venv in the repo and
# install treadle into it (editable) with the extras named in $TREADLE_EXTRAS.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "treadle: creating virtualenv at .venv" >&2
    "$py" -m venv .venv
fi
stamp=".venv/.treadle-installed-${TREADLE_EXTRAS:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "treadle: installing into .venv (extras: ${TREADLE_EXTRAS:-none})" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    if [ -n "${TREADLE_EXTRAS:-}" ]; then
        .venv/bin/python -m pip install -q -e ".[${TREADLE_EXTRAS}]"
    else
        .venv/bin/python -m pip install -q -e .
    fi
    touch "$stamp"
fi
