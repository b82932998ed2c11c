# Sourced by scripts/serve and scripts/test: make .venv (once) and install
# lockd into it in editable mode with the extras given in $LOCKD_EXTRAS.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.lockd-installed${LOCKD_EXTRAS:+-$LOCKD_EXTRAS}"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e "$repo${LOCKD_EXTRAS:+[$LOCKD_EXTRAS]}"
    touch "$stamp"
fi
