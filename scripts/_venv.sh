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
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ] \
    || [ "$repo/client/pyproject.toml" -nt "$stamp" ]; then
    # lockd depends on lockd-client, its own distribution in ./client: both
    # editable in one resolve, so the dependency is met from the checkout.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e "$repo/client" -e "$repo${LOCKD_EXTRAS:+[$LOCKD_EXTRAS]}"
    touch "$stamp"
fi
