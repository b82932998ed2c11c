# Sourced by scripts/serve and scripts/test: make .venv (once) and install
# lockd-client (./client) and lockd into it in editable mode, lockd with the
# extras given in $LOCKD_EXTRAS.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.lockd-installed${LOCKD_EXTRAS:+-$LOCKD_EXTRAS}"
# The install also compiles the daemon's hot path with mypyc (setup.py): do it
# again when one of those sources changed since (lockd.native would otherwise
# run them pure). With LOCKD_PURE_PYTHON=1 nothing is compiled, nor run compiled.
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ] \
    || [ "$repo/client/pyproject.toml" -nt "$stamp" ] || [ "$repo/setup.py" -nt "$stamp" ] \
    || "$venv/bin/python" -c 'import sys, lockd.native as n; sys.exit(not n.needs_rebuild())' \
        2>/dev/null; then
    # lockd depends on lockd-client, its own distribution in ./client: both
    # editable in one resolve, so the dependency is met from the checkout.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e "$repo/client" -e "$repo${LOCKD_EXTRAS:+[$LOCKD_EXTRAS]}"
    touch "$stamp"
fi
