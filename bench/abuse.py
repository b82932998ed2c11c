"""One user against everyone else: what a hostile member costs the others (issue 21).

Run as root (it creates, and removes, a throwaway member)::

    .venv/bin/python bench/abuse.py [rules|park|denials|blank|all] [--seconds 8] [--json]

Each scenario starts a fresh daemon (user mode, socket opened to other uids
as ``lockd serve --system`` would have it), lets the member attack it from
its own processes (the system ``python3``, stdlib only, running as the
member's uid), and measures what the issue names:

- ``rules``: the member floods ``tryAcquire`` of fresh keys (4 connections,
  16 pipelined each) under a rule that costs ~20 ms per evaluation (a
  comprehension over a long list, under the 50 ms ``rule_budget_ms``);
  root's ``hello`` p50 is measured before and during the flood.
- ``park``: 64 connections x 1,024 blocking acquires of a key root holds;
  the daemon's RSS before, while they wait, and after the member left.
- ``denials``: the member floods ``tryAcquire`` of keys the rule denies
  (cheap rule, fresh keys); bytes of daemon log per second.
- ``blank``: one connection sends a bare newline every ~0.1 ms; the daemon's
  CPU seconds per second, against an idle daemon over the same time.

To compare with another checkout, run its copy of this script with its own
virtualenv (``LOCKD_ROOT`` names the checkout whose ``tests/`` helpers to use).
Short runs on a shared 2-CPU box: compare runs made one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("LOCKD_ROOT") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(ROOT))

from lockd.testing.daemon import DaemonProcess, temporary_daemon  # noqa: E402
from lockd.testing.users import Accounts, User, missing_prerequisite, share_socket  # noqa: E402

#: ~20 ms per evaluation with cel-python's interpreter on this box (~0.15 ms an element),
#: under the 50 ms rule_budget_ms (over it, the daemon stops evaluating for the caller).
COSTLY_LIST = ",".join(str(n) for n in range(130))
COSTLY_RULES = (
    '[ruleSet]\nname = "costly"\nresourceType = "lock"\n\n[rules.lock]\n'
    f"acquire = \"[{COSTLY_LIST}].all(x, x >= 0) && record.key.startsWith('flood:')\"\n"
)
CHEAP_RULES = (
    '[ruleSet]\nname = "cheap"\nresourceType = "lock"\n\n[rules.lock]\n'
    "acquire = \"record.key.startsWith('ok:')\"\n"
)

# The member's attacks: stdlib only, run by /usr/bin/python3 as the member.
FLOOD = r"""
import json, socket, sys, time
path, seconds, conns, prefix = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
socks = []
for _ in range(conns):
    s = socket.socket(socket.AF_UNIX); s.connect(path); socks.append([s, b""])
n = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for entry in socks:
        s = entry[0]
        batch = []
        for _ in range(16):
            n += 1
            batch.append(json.dumps({"id": n, "op": "tryAcquire", "key": f"{prefix}{n}",
                                     "ttlMs": 1000}).encode() + b"\n")
        s.sendall(b"".join(batch))
        got = 0
        while got < 16:
            data = s.recv(65536)
            if not data:
                sys.exit("closed")
            got += data.count(b"\n")
print(n)
"""
PARK = r"""
import json, socket, sys, time
path, conns, each, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
socks = []
for c in range(conns):
    s = socket.socket(socket.AF_UNIX); s.connect(path)
    lines = [json.dumps({"id": i, "op": "acquire", "key": key, "ttlMs": 1000,
                         "timeoutMs": 600000}).encode() + b"\n" for i in range(each)]
    s.sendall(b"".join(lines))
    socks.append(s)
print("sent", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
"""
BLANK = r"""
import socket, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
s = socket.socket(socket.AF_UNIX); s.connect(path); s.setblocking(False)
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    try:
        s.send(b"\n"); n += 1
    except BlockingIOError:
        pass
    try:
        s.recv(65536)  # whatever the daemon answers: read and dropped
    except BlockingIOError:
        pass
    time.sleep(0.0001)
print(n)
"""


def as_member(user: User, code: str, *args: object, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["/usr/bin/python3", "-c", code, *map(str, args)],
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        cwd="/",
        text=True,
        **kwargs,
    )


@contextmanager
def daemon(config: str = "", rules: str | None = None) -> Iterator[DaemonProcess]:
    with temporary_daemon(config, rules, prefix="lockd-abuse-") as proc:
        share_socket(proc.socket)
        yield proc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def hello_p50_ms(path: Path, seconds: float) -> tuple[float, int, float]:
    """Root's hello round trips for ``seconds``, one at a time: p50, count, p90 (ms)."""
    samples: list[float] = []
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        buf = b""
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
            started = time.perf_counter()
            sock.sendall(b'{"id":%d,"op":"hello"}\n' % n)
            while b"\n" not in buf:
                buf += sock.recv(65536)
            _, buf = buf.split(b"\n", 1)
            samples.append((time.perf_counter() - started) * 1000)
            time.sleep(0.002)  # a client that asks now and then, not a spinning one
    ordered = sorted(samples)
    return statistics.median(samples), len(samples), ordered[int(0.9 * len(ordered))]


def scenario_rules(user: User, seconds: float) -> dict[str, Any]:
    with daemon(rules=COSTLY_RULES) as d:
        quiet, _, quiet90 = hello_p50_ms(d.socket, min(seconds, 3))
        assert d.proc is not None
        cpu0 = cpu_seconds(d.proc.pid)
        flood = as_member(user, FLOOD, d.socket, seconds + 1, 4, "flood:", stdout=subprocess.PIPE)
        time.sleep(0.5)
        during, count, during90 = hello_p50_ms(d.socket, seconds)
        out, _ = flood.communicate(timeout=seconds + 60)
        cpu = (cpu_seconds(d.proc.pid) - cpu0) / (seconds + 1)
    return {
        "rootHelloP50MsQuiet": round(quiet, 3),
        "rootHelloP50MsDuringFlood": round(during, 3),
        "ratio": round(during / quiet, 2),
        "rootHelloP90MsQuiet": round(quiet90, 3),
        "rootHelloP90MsDuringFlood": round(during90, 3),
        "rootHellos": count,
        "floodRequests": int(out.strip() or 0),
        "daemonCpuPerSecond": round(cpu, 2),
    }


def scenario_park(user: User, seconds: float) -> dict[str, Any]:
    """Two floods one after the other: the second shows whether what stays is reused."""
    result: dict[str, Any] = {}
    with daemon(config="max_pending_per_connection = 1024\n") as d:
        assert d.proc is not None
        pid = d.proc.pid
        with socket.socket(socket.AF_UNIX) as root:
            root.connect(str(d.socket))
            root.sendall(b'{"id":1,"op":"tryAcquire","key":"parked","ttlMs":600000}\n')
            root.recv(65536)
            result["rssMbBefore"] = round(rss_mb(pid), 1)
            for flood in (1, 2):
                park = as_member(
                    user, PARK, d.socket, 64, 1024, "parked",
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )  # fmt: skip
                assert park.stdout is not None and park.stdout.readline().strip() == "sent"
                time.sleep(min(seconds, 5))
                result[f"rssMbWhileWaiting{flood}"] = round(rss_mb(pid), 1)
                assert park.stdin is not None
                park.stdin.write("\n")
                park.stdin.close()
                park.wait(60)
                time.sleep(2)
                root.sendall(b'{"id":2,"op":"hello"}\n')
                root.recv(65536)
                result[f"rssMbAfter{flood}"] = round(rss_mb(pid), 1)
        result["memoryTrimLogged"] = "event=memory_trim" in d.read_log()
    return result


def scenario_denials(user: User, seconds: float) -> dict[str, Any]:
    config = "acquire_per_hour = 1000000000\n"  # the log throttle, not the rate limit
    with daemon(config=config, rules=CHEAP_RULES) as d:
        size0 = d.log.stat().st_size
        flood = as_member(user, FLOOD, d.socket, seconds, 4, "denied:", stdout=subprocess.PIPE)
        out, _ = flood.communicate(timeout=seconds + 60)
        grown = d.log.stat().st_size - size0
    return {
        "logBytesPerSecond": round(grown / seconds),
        "deniedRequests": int(out.strip() or 0),
    }


def scenario_blank(user: User, seconds: float) -> dict[str, Any]:
    with daemon() as d:
        assert d.proc is not None
        pid = d.proc.pid
        cpu0 = cpu_seconds(pid)
        time.sleep(seconds)
        idle = (cpu_seconds(pid) - cpu0) / seconds
        cpu0 = cpu_seconds(pid)
        blank = as_member(user, BLANK, d.socket, seconds, stdout=subprocess.PIPE)
        out, _ = blank.communicate(timeout=seconds + 60)
        busy = (cpu_seconds(pid) - cpu0) / seconds
    return {
        "daemonCpuPerSecondIdle": round(idle, 3),
        "daemonCpuPerSecondBlankLines": round(busy, 3),
        "blankLinesSent": int(out.strip() or 0),
    }


SCENARIOS = {
    "rules": scenario_rules,
    "park": scenario_park,
    "denials": scenario_denials,
    "blank": scenario_blank,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="?", default="all", choices=[*SCENARIOS, "all"])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    why = missing_prerequisite()
    if why is not None:
        sys.exit(f"bench/abuse.py: {why}")
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results: dict[str, Any] = {}
    with Accounts() as accounts:
        member = accounts.user()
        for name in names:
            results[name] = SCENARIOS[name](member, args.seconds)
            if not args.json:
                print(name, json.dumps(results[name]), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
