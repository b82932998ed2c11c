# Sourced by scripts/serve and scripts/test: make .venv (once) and install
# lockd into it in editable mode (it ships lockd_client, from ./client, too),
# with the extras given in $LOCKD_EXTRAS.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.lockd-installed${LOCKD_EXTRAS:+-$LOCKD_EXTRAS}"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ] \
    || [ "$repo/client/pyproject.toml" -nt "$stamp" ]; then
    # lockd ships lockd_client itself; a lockd-client left from an older
    # setup would own the same package, so it goes first.
    if "$venv/bin/python" -m pip show --quiet lockd-client >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall --quiet --yes lockd-client
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e "$repo${LOCKD_EXTRAS:+[$LOCKD_EXTRAS]}"
    touch "$stamp"
fi
