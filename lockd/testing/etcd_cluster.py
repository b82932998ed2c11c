"""A real 3-member etcd cluster on loopback ports, for the etcd backend's tests.

``EtcdCluster`` starts Debian's ``etcd`` (3.4) three times on 127.0.0.1, each
member with free client and peer ports and its own data directory, waits until
every member answers ``/health``, and kills every process it started when it
stops (also when starting failed half-way). Tests can kill, stop and restart
single members and ask which member leads.

It talks to etcd with the standard library only (``urllib``), so a defect in
the daemon's own gateway client cannot make the fixture lie about the
cluster's state.

:class:`EtcdBackend` is the ``[backend]`` table of a lockd serving from such a
cluster (docs/contract.md §11); :class:`lockd.testing.daemon.DaemonProcess`
writes it into a daemon's ``lockd.toml``.

Standard library only; ``bench/`` uses it too. The pytest fixtures are in
``tests/etcd_fixtures.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from lockd.testing.polling import wait_for

ETCD = shutil.which("etcd")
OPENSSL = shutil.which("openssl")

# etcd's defaults (heartbeat 100 ms, election 1000 ms): shorter timeouts make a
# loaded 2-core machine call spurious elections, which would flake the tests.
# Pre-vote on (etcd 3.5's default; off by default on 3.4, which Debian ships):
# without it, a follower whose log is behind starts an election it cannot win,
# and its vote request resets the other follower's election timer, so a leader
# kill took 2-3 s of election in 1 of 7 kills instead of at most 2 s
# (bench/etcd_chaos.py; docs/etcd-design.md §8). The README asks operators for
# the same flag.
ETCD_FLAGS = ("--heartbeat-interval=100", "--election-timeout=1000", "--pre-vote=true")
START_TIMEOUT = 30.0


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, folder: Path) -> TlsFiles:
        """Generate them with ``openssl`` (EC P-256 keys: fast to make)."""
        assert OPENSSL is not None
        folder.mkdir(parents=True, exist_ok=True)
        files = cls(
            *(
                folder / n
                for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
            )
        )
        ca_key = folder / "ca.key"
        ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
        _openssl(f"req -x509 {ec} -keyout {ca_key} -out {files.ca} -days 2 -subj /CN=lockd-ca")
        # The client certificate has no CommonName: etcd 3.4's gateway refuses
        # requests whose certificate has one ("CommonName of client sending a
        # request against gateway will be ignored"), since gRPC would take the
        # CN as the etcd user.
        for cert, key, name, subject, extension in (
            (
                files.server_cert,
                files.server_key,
                "server",
                "/CN=127.0.0.1",
                "subjectAltName=IP:127.0.0.1",
            ),
            (
                files.client_cert,
                files.client_key,
                "client",
                "/O=lockd",
                "extendedKeyUsage=clientAuth",
            ),
        ):
            csr, ext = folder / f"{name}.csr", folder / f"{name}.ext"
            ext.write_text(extension + "\n")
            _openssl(f"req {ec} -keyout {key} -out {csr} -subj {subject}")
            _openssl(
                f"x509 -req -in {csr} -CA {files.ca} -CAkey {ca_key} -CAcreateserial"
                f" -out {cert} -days 2 -extfile {ext}"
            )
        return files

    def server_flags(self) -> list[str]:
        return [
            f"--cert-file={self.server_cert}",
            f"--key-file={self.server_key}",
            f"--trusted-ca-file={self.ca}",
            "--client-cert-auth",
        ]

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context


def _openssl(command: str) -> None:
    # The paths are our own temporary folder's: no spaces, split on blanks.
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *command.split()], check=True, capture_output=True)


@dataclass
class EtcdMember:
    """One ``etcd`` process: its name, ports, data directory and log."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    tls: TlsFiles | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 1.0) -> dict[str, object] | None:
        """``/v3/maintenance/status`` of this member, or None when it does not answer."""
        return self.post("/v3/maintenance/status", {}, timeout)

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when the member answers ``/health`` with ``"health": "true"`` (it has a leader)."""
        context = self.tls.client_context() if self.tls else None
        try:
            with urllib.request.urlopen(
                self.client_url + "/health", timeout=timeout, context=context
            ) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def post(
        self, path: str, body: dict[str, object], timeout: float = 1.0, token: str | None = None
    ) -> dict[str, object] | None:
        """POST to the member's JSON gateway; the reply, or None when it did not answer 200."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        request = urllib.request.Request(
            self.client_url + path, data=json.dumps(body).encode(), headers=headers
        )
        context = self.tls.client_context() if self.tls else None
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
                result = json.loads(reply.read())
        except (OSError, ValueError):
            return None
        return result if isinstance(result, dict) else None


@dataclass
class EtcdCluster:
    """Three etcd members on 127.0.0.1; ``start()``, ``stop()`` and member control."""

    root: Path
    size: int = 3
    tls: TlsFiles | None = None  # serve clients over TLS and require client certificates
    members: list[EtcdMember] = field(default_factory=list)
    flags: tuple[str, ...] = ETCD_FLAGS  # timing flags every member gets (bench/etcd_chaos.py)

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL, in member order."""
        return [m.client_url for m in self.members]

    def start(self, attempts: int = 3) -> EtcdCluster:
        """Start every member and wait until all are healthy.

        A free port found by binding port 0 can be taken by another process
        before etcd binds it; a member that exits at start-up makes the whole
        cluster start again on new ports (``attempts`` times).
        """
        for attempt in range(attempts):
            self._configure(token=f"lockd-test-{os.getpid()}-{attempt}")
            try:
                for member in self.members:
                    self._spawn(member, state="new")
                self.wait_healthy()
                return self
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """SIGKILL every member still running and reap it (etcd needs no clean stop here)."""
        for member in self.members:
            _kill(member)

    def kill(self, member: EtcdMember) -> None:
        """SIGKILL one member (a crash: no leadership transfer)."""
        _kill(member)

    def restart(self, member: EtcdMember, *, wait: bool = True) -> None:
        """Start a killed member again on its own ports and data directory."""
        assert not member.running, f"{member.name} is still running"
        self._spawn(member, state="existing")
        if wait:
            self.wait_healthy([member])

    def wait_healthy(
        self, members: list[EtcdMember] | None = None, timeout: float = START_TIMEOUT
    ) -> None:
        """Wait until each of ``members`` (default: all) answers healthy; RuntimeError if not."""
        waiting = list(self.members if members is None else members)

        def all_healthy() -> bool:
            for member in list(waiting):
                if not member.running:
                    raise RuntimeError(
                        f"etcd member {member.name} exited:\n{self.log_tail(member)}"
                    )
                if member.healthy():
                    waiting.remove(member)
            return not waiting

        try:
            wait_for(all_healthy, timeout, interval=0.05)
        except TimeoutError:
            names = ", ".join(m.name for m in waiting)
            raise RuntimeError(f"etcd members not healthy after {timeout} s: {names}") from None

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        """The member that leads, as the running members agree; waits through an election."""
        found: list[EtcdMember] = []

        def agreed() -> bool:
            by_id: dict[str, EtcdMember] = {}
            leaders: set[str] = set()
            for member in self.members:
                if not member.running:
                    continue
                status = member.status()
                if status is None:
                    continue
                header = status.get("header")
                assert isinstance(header, dict)
                by_id[str(header["member_id"])] = member
                leader_id = str(status.get("leader", "0"))
                if leader_id != "0":
                    leaders.add(leader_id)
            if len(leaders) == 1 and (agreed_on := by_id.get(leaders.pop())) is not None:
                found.append(agreed_on)
                return True
            return False

        try:
            wait_for(agreed, timeout, interval=0.05)
        except TimeoutError:
            raise RuntimeError("no etcd leader that the running members agree on") from None
        return found[-1]

    def followers(self) -> list[EtcdMember]:
        """The running members that do not lead."""
        leader = self.leader()
        return [m for m in self.members if m.running and m is not leader]

    def enable_auth(self, root_password: str) -> None:
        """Create etcd's ``root`` user with ``root_password`` and turn authentication on."""
        member = self.members[0]
        steps: list[tuple[str, dict[str, object]]] = [
            ("/v3/auth/user/add", {"name": "root", "password": root_password}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ]
        for path, body in steps:
            if member.post(path, body, timeout=5.0) is None:
                raise RuntimeError(f"etcd refused {path}")

    def log_tail(self, member: EtcdMember, lines: int = 20) -> str:
        try:
            return "\n".join(member.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _configure(self, token: str) -> None:
        ports = free_ports(2 * self.size)
        self.token = token
        self.members = []
        for i in range(self.size):
            name = f"m{i}"
            data_dir = self.root / token / name
            self.members.append(
                EtcdMember(
                    name=name,
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=data_dir,
                    log=self.root / token / f"{name}.log",
                    tls=self.tls,
                )
            )

    def _spawn(self, member: EtcdMember, *, state: str) -> None:
        assert ETCD is not None
        member.data_dir.mkdir(parents=True, exist_ok=True)
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        with member.log.open("ab") as log:
            member.proc = subprocess.Popen(
                [
                    ETCD,
                    f"--name={member.name}",
                    f"--data-dir={member.data_dir}",
                    f"--listen-client-urls={member.client_url}",
                    f"--advertise-client-urls={member.client_url}",
                    f"--listen-peer-urls={member.peer_url}",
                    f"--initial-advertise-peer-urls={member.peer_url}",
                    f"--initial-cluster={initial}",
                    f"--initial-cluster-token={self.token}",
                    f"--initial-cluster-state={state}",
                    "--logger=zap",
                    "--log-level=warn",
                    *self.flags,
                    *(member.tls.server_flags() if member.tls else []),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group: a Ctrl-C on the test run reaches pytest,
                # whose teardown kills the members, not the members directly.
                start_new_session=True,
            )


@dataclass(frozen=True)
class EtcdBackend:
    """What a lockd needs to serve from an etcd cluster: its ``[backend]`` table.

    Every daemon of a test gets a prefix of its own (:meth:`on`), so tests on
    the session cluster never see each other's keys; daemons standing for
    several hosts of one test share the prefix and differ in ``node``.
    """

    endpoints: tuple[str, ...]
    prefix: str
    node: str | None = None
    session_ttl: int | None = None
    etcd_timeout: int | None = None
    #: further ``[backend]`` keys (TLS files, auth), written as they are.
    extra: tuple[tuple[str, str | int], ...] = ()

    @classmethod
    def on(cls, cluster: EtcdCluster, **settings: object) -> EtcdBackend:
        """A backend on ``cluster`` under a fresh, unique prefix."""
        prefix = f"/lockd-test/{uuid.uuid4().hex[:12]}/"
        backend = cls(endpoints=tuple(cluster.endpoints), prefix=prefix)
        return replace(backend, **settings)  # type: ignore[arg-type]

    def as_node(self, node: str) -> EtcdBackend:
        """The same cluster and prefix, for the daemon of another host."""
        return replace(self, node=node)

    def toml(self) -> str:
        """The ``[backend]`` table (JSON strings are valid TOML basic strings)."""
        values: list[tuple[str, object]] = [
            ("kind", "etcd"),
            ("endpoints", list(self.endpoints)),
            ("prefix", self.prefix),
            ("node", self.node),
            ("session_ttl", self.session_ttl),
            ("etcd_timeout", self.etcd_timeout),
            *self.extra,
        ]
        lines = [f"{key} = {json.dumps(value)}" for key, value in values if value is not None]
        return "\n".join(["[backend]", *lines, ""])


def _kill(member: EtcdMember) -> None:
    if member.proc is None:
        return
    if member.proc.poll() is None:
        member.proc.send_signal(signal.SIGKILL)
    member.proc.wait()


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def data_root() -> Path:
    # Data directories on tmpfs when there is one: etcd fsyncs its WAL on every
    # commit, and on a shared disk that makes the tests slow, not more real.
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="lockd-etcd-", dir=base))
