"""What ``LockClient`` costs on top of the wire: ``.venv/bin/python bench/client_overhead.py``.

A trivial blocking fake server (a separate process, so it does not compete
with the client for the GIL) answers every request with a canned reply. The
same process then runs, interleaved round by round:

raw     the floor: ``sendall`` + buffered ``readline`` + stdlib ``json``,
        one ``tryAcquire`` and one ``release`` per pair;
client  ``LockClient.try_acquire`` + ``LockClient.release`` (argument checks,
        shared-connection bookkeeping, reply decoding into a ``Handle``).

It prints, per loop, the median pairs per second (wall clock) and the
median CPU time the client process spent per pair, and the ratios (raw /
client rate; 1.0 would be a free client). The box is shared and noisy: read
the ratios of the same run, not the absolute numbers; the CPU time per pair
is the steadiest figure when other work competes for the cores.

``--profile`` runs the client loop once under cProfile and prints the top
functions by own time. ``--client-dir DIR`` imports ``lockd_client`` from
another checkout (``git archive <rev> client | tar -x -C /tmp/old``, then
``--client-dir /tmp/old/client``) to compare before and after a change.

Measured on the 2-core dev box (9 rounds x 2000 pairs, three runs each): the
client before the hot-path rework (bc6b828) did 5.0-10.2 k pairs/s, 2.0-2.6x
slower than the raw loop (66-128 µs CPU per pair); after it, 17.0-17.6 k
pairs/s, 1.18-1.21x (33 µs CPU per pair, raw 25 µs).

``--instructions`` counts instead of timing: each loop runs under valgrind's
callgrind for N and N/10 pairs, and the difference gives user-space
instructions per pair, steady under any load. Client cpu-work rework
(98a6884 against 707cac6): 161.9 k -> 126.3 k instructions per pair, the raw
loop 122 k (bench/README.md, "The client's own CPU"); second round (issue 25,
against 0a96614): 134.3 k -> 122.0 k.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# --client-dir DIR (e.g. an older checkout's client/) is honoured before the import.
_CLIENT_DIR = _ROOT / "client"
if "--client-dir" in sys.argv[:-1]:
    _CLIENT_DIR = Path(sys.argv[sys.argv.index("--client-dir") + 1]).resolve()
sys.path.insert(0, str(_CLIENT_DIR))

from lockd_client import LockClient  # noqa: E402

KEY = "bench:client-overhead"
HANDLE_ID = "h" * 22
GRANT_HEAD = f'{{"key":"{KEY}","handle":"{HANDLE_ID}","fence":'
GRANT_TAIL = ',"owner":null,"ttlMs":30000,"leaseExpiresAt":"2026-11-30T03:31:00.123Z"}'


# ----------------------------------------------------------------- the server


def serve(path: str) -> None:
    """Accept connections on ``path`` and answer each line with a canned reply.

    Each connection gets a thread; the reply echoes the request's ``id``.
    ``tryAcquire``/``acquire`` get a grant, ``release`` ``released: true``,
    anything else ``{}``. Writes ``ready`` to stdout once listening.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def _answer(conn: socket.socket) -> None:
    fence = 0
    reader = conn.makefile("rb")
    loads = json.JSONDecoder().decode
    with conn, reader:
        for line in reader:
            request = loads(line.decode())
            op = request.get("op")
            if op in ("tryAcquire", "acquire"):
                fence += 1
                result = f"{GRANT_HEAD}{fence}{GRANT_TAIL}"
            elif op == "release":
                result = '{"released":true}'
            else:
                result = "{}"
            reply = f'{{"id":{request["id"]},"ok":true,"result":{result}}}\n'
            try:
                conn.sendall(reply.encode())
            except OSError:
                return


class FakeServer:
    """The fake server as a child process on a socket in a private temp dir."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="lkb", dir="/tmp")  # AF_UNIX paths are short
        self.path = os.path.join(self._dir, "s.sock")
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", self.path],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the fake server did not start")

    def close(self) -> None:
        """Stop the child and remove the socket directory."""
        self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


# ------------------------------------------------------------------ the loops


def raw_loop(path: str, pairs: int) -> tuple[float, float]:
    """(wall, CPU) seconds for ``pairs`` tryAcquire+release pairs over a bare socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reader = sock.makefile("rb")
    dumps, loads = json.dumps, json.loads
    rid = 0
    try:
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(pairs):
            rid += 1
            req = {"id": rid, "op": "tryAcquire", "key": KEY, "ttlMs": 30000}
            sock.sendall(dumps(req).encode() + b"\n")
            grant = loads(reader.readline())["result"]
            rid += 1
            req = {"id": rid, "op": "release", "key": KEY, "handle": grant["handle"]}
            sock.sendall(dumps(req).encode() + b"\n")
            loads(reader.readline())
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        reader.close()
        sock.close()


def client_loop(path: str, pairs: int) -> tuple[float, float]:
    """(wall, CPU) seconds for ``pairs`` ``try_acquire`` + ``release`` pairs via LockClient."""
    with LockClient(path) as client:
        client.hello()  # connect outside the timed part, as the raw loop does
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(pairs):
            handle = client.try_acquire(KEY, ttl=30)
            assert handle is not None
            client.release(handle)
        return time.perf_counter() - started, time.process_time() - cpu


_LOOPS: dict[str, Callable[[str, int], tuple[float, float]]] = {
    "raw": raw_loop,
    "client": client_loop,
}


def run_rounds(path: str, rounds: int, pairs: int) -> dict[str, dict[str, list[float]]]:
    """Per round and loop: pairs/s (wall) and client CPU µs per pair, interleaved."""
    loops = _LOOPS
    for loop in loops.values():  # warm-up: imports, caches, the server's first thread
        loop(path, max(1, pairs // 10))
    out: dict[str, dict[str, list[float]]] = {name: {"rate": [], "cpu_us": []} for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            wall, cpu = loop(path, pairs)
            out[name]["rate"].append(pairs / wall)
            out[name]["cpu_us"].append(cpu / pairs * 1e6)
    return out


def count_instructions(path: str, pairs: int) -> dict[str, float]:
    """Instructions per pair of each loop, counted by valgrind (callgrind), not timed.

    Each loop runs in a child process under callgrind twice, for ``pairs``
    and for ``pairs // 10`` pairs; the difference divided by the difference
    in pairs leaves out start-up and the first connection. User-space
    instructions only (system calls show as one instruction each): the one
    figure the shared box's load does not move, so a 2 % change in the
    client's own work shows, where CPU time per pair needs many rounds.
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    few = max(1, pairs // 10)
    out: dict[str, float] = {}
    for name in _LOOPS:
        counts = []
        for n in (few, pairs):
            command = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null"]
            command += [sys.executable, __file__, "--client-dir", str(_CLIENT_DIR)]
            command += ["--count-loop", name, "--pairs", str(n), path]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            found = re.search(r"Collected : (\d+)", done.stderr)
            if found is None:
                raise RuntimeError(f"no instruction count from callgrind: {done.stderr[-500:]}")
            counts.append(int(found.group(1)))
        out[name] = (counts[1] - counts[0]) / (pairs - few)
    return out


def profile(path: str, pairs: int, top: int) -> None:
    """The client loop under cProfile, top ``top`` functions by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(client_loop, path, pairs)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pairs", type=int, default=2000, help="pairs per round and loop")
    parser.add_argument("--profile", action="store_true", help="cProfile the client loop")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON too")
    parser.add_argument(
        "--client-dir",
        metavar="DIR",
        help="import lockd_client from DIR (default: this checkout's client/)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per pair with valgrind instead of timing (steady under load)",
    )
    parser.add_argument("--serve", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--count-loop", choices=sorted(_LOOPS), help=argparse.SUPPRESS)
    parser.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        with contextlib.suppress(KeyboardInterrupt):
            serve(args.serve)
        return
    if args.count_loop:  # a child of --instructions, under valgrind
        _LOOPS[args.count_loop](args.path, args.pairs)
        return
    server = FakeServer()
    try:
        if args.profile:
            profile(server.path, args.pairs, 25)
            return
        if args.instructions:
            counts = count_instructions(server.path, args.pairs)
            print(f"instructions per pair (callgrind, user space), fake server, {args.pairs} pairs")
            print(f"  lockd_client from {_CLIENT_DIR / 'lockd_client'}")
            for name, count in counts.items():
                print(f"  {name:<7} {count:>10,.0f}")
            print(f"  client/raw {counts['client'] / counts['raw']:.2f}x")
            return
        data = run_rounds(server.path, args.rounds, args.pairs)
    finally:
        server.close()
    median = statistics.median
    print(f"{args.rounds} rounds x {args.pairs} pairs (try_acquire + release), fake server")
    print(f"  lockd_client from {Path(sys.modules['lockd_client'].__file__ or '?').parent}")
    for name, m in data.items():
        spread = ", ".join(f"{v:,.0f}" for v in m["rate"])
        print(
            f"  {name:<7} median {median(m['rate']):>8,.0f} pairs/s, "
            f"{median(m['cpu_us']):6.1f} µs CPU/pair   [{spread}]"
        )
    raw, client = data["raw"], data["client"]
    per_round = [r / c for r, c in zip(raw["rate"], client["rate"], strict=True)]
    print(
        f"  ratio raw/client: {median(raw['rate']) / median(client['rate']):.2f}x of medians, "
        f"{median(per_round):.2f}x median per round; "
        f"CPU client/raw {median(client['cpu_us']) / median(raw['cpu_us']):.2f}x"
    )
    if args.json:
        print(json.dumps(data))


if __name__ == "__main__":
    main()
