"""The names of the ``stats`` op's counters and gauges, and what each counts.

One list for the daemon, which counts them (:mod:`lockd.daemon.stats`), and
for ``lockd stats``, which explains them (OpenMetrics ``# HELP`` lines).
Shared at the top because the command line must not import the daemon.
"""

from __future__ import annotations

#: counter name -> help text, in the order ``stats`` reports them.
COUNTERS: dict[str, str] = {
    "grants": "Leases granted.",
    "retakes": "Holds re-taken by the same principal and owner.",
    "handoffs": "Grants to a blocking acquire that had waited (a release, expiry or break "
    "handed the key over).",
    "releases": "Leases released.",
    "renewals": "Leases renewed.",
    "expiries": "Leases that ran out.",
    "timeouts": "Blocking acquires that timed out.",
    "denials": "Requests denied by rules or roles.",
    "rateLimited": "Acquire attempts refused by the rate limit.",
    "breaks": "Locks broken by an owner or admin.",
    "invalidRequests": "Requests refused as invalid.",
    "internalErrors": "Requests that failed with an internal error.",
    "storageErrors": "Requests refused because the database could not be written.",
    "backendUnavailable": "Requests refused because the etcd backend did not answer in time.",
    "connectionsAccepted": "Client connections accepted.",
    "connectionsRefused": (
        "Client connections refused (over max_connections or max_connections_per_uid, "
        "no descriptor, or no identity)."
    ),
    "connectionsStalled": "Connections closed on an incomplete request line.",
}

#: gauge name -> help text.
GAUGES: dict[str, str] = {
    "uptimeMs": "Time since the daemon started.",
    "connections": "Open client connections.",
    "held": "Keys held now (null with the etcd backend: no host counts every host's keys).",
    "waiters": "Acquires parked in wait queues now (with etcd: this daemon's).",
    "fence": "The last fence issued (never goes backwards; with etcd: by this daemon).",
    "node": "This daemon's node name (etcd backend; null with SQLite).",
}
