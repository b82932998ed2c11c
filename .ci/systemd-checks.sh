#!/usr/bin/env bash
# Static checks of the systemd units in systemd/ (no running systemd needed):
#
#   1. `systemd-analyze verify` on the system and user units. Any output counts
#      as a failure: verify only warns (exit 0) about unknown or misspelt keys.
#   2. The ExecStart= binary. verify insists that it exists. The shipped path
#      (/usr/local/bin/lockd, %h/.local/bin/lockd) is where an install puts
#      it, not where this checkout has it, so when it is absent the units are
#      verified from a temporary copy whose ExecStart points at this checkout's
#      console script ($LOCKD_BIN, else `lockd` on PATH, else .venv/bin/lockd),
#      arguments unchanged, and the summary says so. No console script at all
#      is a failure. The arguments are checked too: `lockd serve --system
#      --help` must exit 0, i.e. the CLI accepts them.
#   3. `systemd-sysusers --dry-run` on the sysusers.d entry.
#   4. `systemd-analyze security --offline=yes` on systemd/lockd.service:
#      fails when the overall exposure is above $LOCKD_MAX_EXPOSURE (2.0).
#   5. The system daemon only reads its configuration: no
#      ConfigurationDirectory= (systemd chowns it to User= and mounts it
#      read-write), no ReadWritePaths= under /etc, ProtectSystem=strict; and
#      both services set LimitNOFILE= (systemd's default soft limit is 1024).
#
# Installs Debian's systemd package when systemd-analyze is missing (CI runs as
# root). Exit status 0 when every check passed, 1 otherwise.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
units=${LOCKD_UNITS_DIR:-$repo/systemd}  # overridable so the tests can check broken copies
max_exposure=${LOCKD_MAX_EXPOSURE:-2.0}
failures=0
summary=()

ok()   { summary+=("  ok    $1"); }
bad()  { summary+=("  FAIL  $1"); failures=$((failures + 1)); }
note() { summary+=("        $1"); }

if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "systemd-analyze not found: installing Debian's systemd package" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd; } >/dev/null; then
            echo "systemd-checks: FAIL: could not install systemd" >&2
            exit 1
        fi
    else
        echo "systemd-checks: FAIL: systemd-analyze not found (install Debian's systemd package)" >&2
        exit 1
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- the lockd console script to verify against -------------------------------
lockd_bin=${LOCKD_BIN:-}
if [ -z "$lockd_bin" ]; then
    if command -v lockd >/dev/null 2>&1; then
        lockd_bin=$(command -v lockd)
    elif [ -x "$repo/.venv/bin/lockd" ]; then
        lockd_bin="$repo/.venv/bin/lockd"
    fi
fi

# exec_start FILE -> the ExecStart= value (last non-empty one)
exec_start() { sed -n 's/^ExecStart=\(..*\)$/\1/p' "$1" | tail -n 1; }

# shipped_bin UNIT: the ExecStart= binary with %h expanded as systemd would.
shipped_bin() { local cmd; cmd=$(exec_start "$1"); cmd=${cmd%% *}; printf '%s' "${cmd//%h/$HOME}"; }

# prepare_units LABEL SRC_DIR DEST_DIR: copy the units; when the shipped
# ExecStart binary is absent, point it at $lockd_bin and record that.
prepare_units() {
    local label=$1 src=$2 dest=$3 cmd bin resolved
    mkdir -p "$dest"
    cp "$src"/lockd.service "$src"/lockd.socket "$dest"/
    cmd=$(exec_start "$dest/lockd.service")
    bin=${cmd%% *}
    resolved=$(shipped_bin "$dest/lockd.service")
    if [ -x "$resolved" ]; then
        note "$label lockd.service: ExecStart binary $resolved exists"
        return 0
    fi
    if [ -z "$lockd_bin" ] || [ ! -x "$lockd_bin" ]; then
        bad "$label lockd.service: ExecStart binary $bin is absent and no lockd console script was found (install the project, or set LOCKD_BIN)"
        return 1
    fi
    # Replace only the binary; keep the arguments as shipped.
    local escaped_bin escaped_new
    escaped_bin=$(printf '%s' "$bin" | sed 's/[][\.*^$/]/\\&/g')
    escaped_new=$(printf '%s' "$lockd_bin" | sed 's/[&/\]/\\&/g')
    sed -i "s/^ExecStart=$escaped_bin\( \|\$\)/ExecStart=$escaped_new\1/" "$dest/lockd.service"
    note "$label lockd.service: ExecStart=$cmd (absent here); verified with $lockd_bin instead"
}

# run_verify LABEL DIR [--user]: verify both units; any output is a failure.
run_verify() {
    local label=$1 dir=$2 scope=${3:-} out rc
    local -a scope_args=()
    [ -n "$scope" ] && scope_args=("$scope")
    out=$(cd "$dir" && XDG_RUNTIME_DIR="$work/xdg-runtime" systemd-analyze "${scope_args[@]}" verify ./lockd.service ./lockd.socket 2>&1)
    rc=$?
    if [ $rc -eq 0 ] && [ -z "$out" ]; then
        ok "$label: systemd-analyze ${scope:+$scope }verify clean"
    else
        bad "$label: systemd-analyze ${scope:+$scope }verify (exit $rc):"
        while IFS= read -r line; do note "$line"; done <<<"$out"
    fi
}

mkdir -p "$work/xdg-runtime" && chmod 0700 "$work/xdg-runtime"

# --- 1+2: verify -----------------------------------------------------------------
if prepare_units system "$units" "$work/system"; then
    run_verify "system units" "$work/system"
fi
if prepare_units user "$units/user" "$work/user"; then
    run_verify "user units" "$work/user" --user
fi

# --- 2b: the CLI accepts ExecStart's arguments -----------------------------------
# check_args LABEL UNIT: the installed binary if present, else this checkout's.
check_args() {
    local label=$1 unit=$2 bin cmd args out rc
    bin=$(shipped_bin "$unit")
    [ -x "$bin" ] || bin=$lockd_bin
    if [ -z "$bin" ] || [ ! -x "$bin" ]; then
        return 0  # already reported by prepare_units
    fi
    cmd=$(exec_start "$unit")
    args=${cmd#* }
    [ "$args" = "$cmd" ] && args=""
    # shellcheck disable=SC2086  # word splitting of the unit's arguments is intended
    out=$("$bin" $args --help 2>&1)
    rc=$?
    if [ $rc -eq 0 ]; then
        ok "$label: \`lockd $args --help\` accepts ExecStart's arguments"
    else
        bad "$label: \`lockd $args --help\` exited $rc: $(printf '%s' "$out" | tail -n 1)"
    fi
}
check_args "system ExecStart" "$units/lockd.service"
check_args "user ExecStart" "$units/user/lockd.service"

# --- 3: sysusers entry ------------------------------------------------------------
if command -v systemd-sysusers >/dev/null 2>&1; then
    if out=$(systemd-sysusers --dry-run "$units/lockd.sysusers" 2>&1); then
        ok "lockd.sysusers: systemd-sysusers --dry-run accepts it"
    else
        bad "lockd.sysusers: systemd-sysusers --dry-run: $out"
    fi
else
    note "systemd-sysusers not installed; lockd.sysusers not checked"
fi

# --- 4: security exposure -----------------------------------------------------------
security_out=$(systemd-analyze security --offline=yes --no-pager "$units/lockd.service" 2>&1)
exposure=$(printf '%s\n' "$security_out" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' | tail -n 1)
if [ -z "$exposure" ]; then
    bad "lockd.service: no exposure level in systemd-analyze security output:"
    while IFS= read -r line; do note "$line"; done <<<"$security_out"
elif awk -v e="$exposure" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }'; then
    ok "lockd.service: security exposure $exposure (limit $max_exposure)"
    while IFS= read -r line; do note "$line"; done < <(printf '%s\n' "$security_out" | grep '^✗' | sed 's/  */ /g')
else
    bad "lockd.service: security exposure $exposure is above $max_exposure; settings not tightened:"
    while IFS= read -r line; do note "$line"; done < <(printf '%s\n' "$security_out" | grep '^✗' | sed 's/  */ /g')
fi

# --- 5: read-only configuration, file descriptor limit ---------------------------------
# unit_values FILE KEY: the values of KEY= in FILE, one a line (comments skipped).
unit_values() { sed -n "s/^[[:space:]]*$2=\(.*\)\$/\1/p" "$1"; }
system_service=$units/lockd.service
if [ -n "$(unit_values "$system_service" ConfigurationDirectory)" ]; then
    bad "lockd.service: ConfigurationDirectory= hands /etc/lockd to the daemon's user, read-write"
elif unit_values "$system_service" ReadWritePaths | grep -q '/etc'; then
    bad "lockd.service: ReadWritePaths= opens part of /etc to the daemon"
elif [ "$(unit_values "$system_service" ProtectSystem | tail -n 1)" != strict ]; then
    bad "lockd.service: ProtectSystem= is not strict, so /etc/lockd is not read-only to the daemon"
else
    ok "lockd.service: /etc/lockd is read-only to the daemon (no ConfigurationDirectory=, ProtectSystem=strict)"
fi
for service in "$system_service" "$units/user/lockd.service"; do
    label=${service#"$units"/}
    nofile=$(unit_values "$service" LimitNOFILE | tail -n 1)
    if [ -z "$nofile" ]; then
        bad "$label: no LimitNOFILE= (systemd's default soft limit of 1024 caps connections)"
    else
        ok "$label: LimitNOFILE=$nofile"
    fi
done

echo "systemd checks ($(systemd-analyze --version | head -n 1)):"
printf '%s\n' "${summary[@]}"
if [ "$failures" -gt 0 ]; then
    echo "systemd checks: $failures failed"
    exit 1
fi
echo "systemd checks: all passed"
