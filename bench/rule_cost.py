"""What does a lock rule cost a member? tryAcquire+release round trips, with and without.

Run as root (it creates, and removes, a throwaway user)::

    .venv/bin/python bench/rule_cost.py [--iterations 500] [--rounds 6] [--json]

Two real daemons run side by side, one with no rule set (the open default)
and one with the docs/contract.md §5 example rule::

    acquire = "record.key.startsWith('user:' + user.userId + ':')"

A member (the throwaway user; root would be ``owner`` and skip the rules)
times each tryAcquire+release round trip of ``user:<name>:bench`` (and, in a
second measurement, of a key never used before each time, which misses the
daemon's verdict cache) inside its own client process, so the numbers are
what a program sees, without the bench's own plumbing. Why this shape:

- **Same run, interleaved.** The two daemons are measured in alternating
  rounds (the order flips every round), so load from other work on the
  machine hits both alike; comparing numbers from separate runs is noise.
- **Medians.** p50 of all samples per configuration, plus the median of the
  per-round differences (paired by round), which is the steadier estimate of
  the added cost. p90/p99 are printed for context only.
- **Rate limit out of the way.** ``acquire_per_hour`` is set huge in both
  daemons, so both pay the same counting cost and nobody gets refused.

Only ``tryAcquire`` is rule-gated; ``release`` is not (docs/contract.md §5), so the added
cost is one CEL evaluation per round trip.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lockd.testing.daemon import DaemonProcess, temporary_daemon  # noqa: E402
from lockd.testing.users import Accounts, Agent, User, missing_prerequisite, share_socket  # noqa: E402

SPEC_RULE = "record.key.startsWith('user:' + user.userId + ':')"
RULE_SET = (
    '[ruleSet]\nname = "lock-policy"\nresourceType = "lock"\n\n'
    f'[rules.lock]\nacquire = "{SPEC_RULE}"\nrenew = "{SPEC_RULE}"\n'
)
CONFIG = "acquire_per_hour = 1000000000\n"


def start_daemon(stack: ExitStack, rules: str | None) -> DaemonProcess:
    """A daemon in its own temp folder, reachable by other uids; stopped on exit."""
    daemon = stack.enter_context(
        temporary_daemon(CONFIG, rules, rules_file="lock-policy.toml", prefix="lockd-bench-")
    )
    share_socket(daemon.socket)
    return daemon


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    user: User, iterations: int, rounds: int, warmup: int, *, distinct: bool = False
) -> dict[str, Any]:
    key = f"user:{user.name}:bench"
    with ExitStack() as stack:
        daemons = {"open": start_daemon(stack, None), "rule": start_daemon(stack, RULE_SET)}
        agents = {name: stack.enter_context(Agent(user, d.socket)) for name, d in daemons.items()}
        # Sanity: the rule is in force for this member, and is not in the other daemon.
        denied = agents["rule"].error("try_acquire", "not-mine", 5)
        assert denied.code == "LOCK_ACCESS_DENIED", denied
        assert agents["open"].call("try_acquire", "not-mine", 5) is not None
        for agent in agents.values():
            agent.call("bench", key, warmup, 30.0, distinct)

        samples: dict[str, list[float]] = {"open": [], "rule": []}
        round_medians: dict[str, list[float]] = {"open": [], "rule": []}
        for number in range(rounds):
            order = ("open", "rule") if number % 2 == 0 else ("rule", "open")
            for name in order:
                timed = agents[name].call("bench", key, iterations, 30.0, distinct)
                micros = [ns / 1000 for ns in timed]
                samples[name].extend(micros)
                round_medians[name].append(statistics.median(micros))

    result: dict[str, Any] = {
        "iterations": iterations,
        "rounds": rounds,
        "rule": SPEC_RULE,
        "keys": "a new key every round trip" if distinct else "the same key every round trip",
    }
    for name, values in samples.items():
        result[name] = {
            "p50_us": statistics.median(values),
            "p90_us": percentile(values, 0.90),
            "p99_us": percentile(values, 0.99),
            "round_p50_us": round_medians[name],
        }
    p50_open, p50_rule = result["open"]["p50_us"], result["rule"]["p50_us"]
    paired = [r - o for o, r in zip(round_medians["open"], round_medians["rule"], strict=True)]
    result["ratio_p50"] = p50_rule / p50_open
    result["added_p50_us"] = p50_rule - p50_open
    result["added_paired_median_us"] = statistics.median(paired)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"tryAcquire+release round trip of a member, {result['rounds']} rounds x "
        f"{result['iterations']} per configuration, {result['keys']} (µs)",
        f"{'':14}{'p50':>9}{'p90':>9}{'p99':>9}   per-round p50",
    ]
    for name, label in (("open", "no rule set"), ("rule", "docs/contract.md §5 rule")):
        r = result[name]
        rounds = " ".join(f"{v:.0f}" for v in r["round_p50_us"])
        lines.append(f"{label:14}{r['p50_us']:9.1f}{r['p90_us']:9.1f}{r['p99_us']:9.1f}   {rounds}")
    lines.append(
        f"rule cost: ratio {result['ratio_p50']:.2f}x, "
        f"+{result['added_p50_us']:.1f} µs at p50 "
        f"(median of per-round differences: +{result['added_paired_median_us']:.1f} µs)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500, help="round trips per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per configuration")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    why = missing_prerequisite()
    if why is not None:
        print(f"rule_cost: {why}", file=sys.stderr)
        return 2
    with Accounts() as accounts:
        user = accounts.user()
        # The daemon remembers verdicts per (caller, key): the same key again
        # is the cached path; a new key every time pays the CEL evaluation.
        results = [
            measure(user, args.iterations, args.rounds, args.warmup, distinct=distinct)
            for distinct in (False, True)
        ]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\n\n".join(report(result) for result in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
