"""The allowed backend differences are listed once (tests/backend_differences.py).

docs/contract.md §11 shows the list as a table; the tests may tell the
backends apart only through its names.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.backend_differences import DIFFERENCES, TABLE_HEADER, difference, table_rows
from tests.conftest import Backend

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
#: The registry and the fixtures that consult it; every other module goes through them.
PLUMBING = {"backend_differences.py", "conftest.py", Path(__file__).name}
NAMED = re.compile(r"""\bdiffers\(\s*["']([a-z_]+)["']""")


def contract_section_11() -> str:
    text = (ROOT / "docs" / "contract.md").read_text()
    start = text.index("\n## 11. ")
    return text[start : text.index("\n## 12. ", start)]


def test_contract_table_is_the_registry() -> None:
    lines = [line for line in contract_section_11().splitlines() if line.startswith("|")]
    assert lines == [*TABLE_HEADER, *table_rows()], (
        "docs/contract.md §11's table of allowed differences and tests/backend_differences.py "
        "disagree: `python -m tests.backend_differences` prints the table"
    )


def test_every_entry_says_what_and_why_and_cites_the_contract() -> None:
    for name, entry in DIFFERENCES.items():
        assert entry.name == name and re.fullmatch(r"[a-z_]+", name)
        assert entry.differs.strip() and "|" not in entry.differs + entry.why
        assert re.search(r"§\d+", entry.why), f"{name}: say which section allows it"


def test_an_unknown_name_fails_on_either_backend() -> None:
    with pytest.raises(KeyError, match="no allowed backend difference"):
        Backend("sqlite").differs("etcd_is_slower")
    assert Backend("sqlite").differs("whole_second_ttl") is False


def test_modules_name_differences_and_never_ask_the_backend_directly() -> None:
    used = set(NAMED.findall((TESTS / "conftest.py").read_text()))  # Backend's helpers
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in PLUMBING:
            continue
        text = path.read_text()
        assert "is_etcd" not in text, f"{path.name}: name a difference instead"
        if "backend: Backend" in text:  # the fixture (test_config has a config `backend`)
            asked = re.findall(r"\bbackend\.(?:kind|cluster)\b", text)
            assert not asked, f"{path.name}: name a difference instead of {asked}"
        for name in NAMED.findall(text):
            difference(name)
            used.add(name)
    tested = {name for name, entry in DIFFERENCES.items() if not entry.untested}
    assert used == tested, f"named by no test: {tested - used}; tested now: {used - tested}"
