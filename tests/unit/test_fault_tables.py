"""The fault tables of the docs and the tests stay in step: every test a table names exists,
and every test of the fault modules is in a table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "docs/runtime-cache.md": ROOT / "tests" / "integration",
    "docs/serving.md": ROOT / "tests",
}
FAULT_MODULES = ("tests/integration/test_cache_faults.py",)
REFERENCE = re.compile(r"`((?:[a-z_]+/)?test_[a-z_]+\.py)::(test_[a-z0-9_]+)`")


def named_tests(doc: str) -> list[tuple[str, str]]:
    text = (ROOT / doc).read_text()
    faults = text[text.index("## Faults") :]
    rows = [line for line in faults.splitlines() if line.startswith("| ")]
    return [match for row in rows[2:] for match in REFERENCE.findall(row)]


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("doc", TABLES)
def test_every_test_a_fault_table_names_exists(doc: str) -> None:
    named = named_tests(doc)
    assert named, f"{doc} has no fault table"
    missing = [
        f"{module}::{test}"
        for module, test in named
        if test not in defined_tests(TABLES[doc] / module)
    ]
    assert missing == []


def test_every_fault_test_is_in_a_table() -> None:
    named = {test for doc in TABLES for _, test in named_tests(doc)}
    for module in FAULT_MODULES:
        tests = {name for name in defined_tests(ROOT / module) if name.startswith("test_")}
        assert tests - named == set(), module
