"""``lockd locks list`` on etcd: a NODE column, shown only when the daemon names nodes."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner, Result
from lockd_client import LockClient, LockStatus

from lockd.cli import main
from tests.live.test_cli_holders import holder, wire_status


def _on(node: str, entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "node": node}


ON_ETCD = wire_status(
    "deploy",
    "shared",
    1,
    [
        _on("web-1", holder("user:bob", None, 5, 901, "cat")),
        _on("web-2", holder("user:eve", None, 6, 902, "less")),
    ],
)
ON_SQLITE = wire_status("local", "exclusive", 1, [holder("user:bob", None, 7, 903, "vi")])


def listing(monkeypatch: pytest.MonkeyPatch, *documents: dict[str, Any]) -> Result:
    def list_page(self: LockClient, *args: object) -> tuple[list[LockStatus], None]:
        return [
            LockStatus.from_result({**d, "node": d["holders"][0].get("node")}) for d in documents
        ], None

    monkeypatch.setattr(LockClient, "list_page", list_page)
    return CliRunner().invoke(main, ["locks", "list", "--socket", "/nowhere"], prog_name="lockd")


def test_list_shows_each_holders_node_on_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    result = listing(monkeypatch, ON_ETCD)
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split()[-1] == "NODE"
    assert rows[0].split()[-1] == "web-1" and rows[1].split()[-1] == "web-2"


def test_list_has_no_node_column_without_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    result = listing(monkeypatch, ON_SQLITE)
    assert result.exit_code == 0, result.output
    header = result.output.splitlines()[0]
    assert "NODE" not in header and header.split()[-1] == "WAITERS"
