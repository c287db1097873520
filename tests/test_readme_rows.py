"""The README's "When something is wrong" table: each row says which test backs it; those tests must exist, so the
table cannot go on naming a test that was renamed or removed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rows() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## When something is wrong", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Bad input")]
    return [row.rstrip(" |").rsplit("|", 1)[1].strip() for row in rows]


def test_every_row_of_the_trouble_table_names_tests_that_exist():
    cells = _rows()
    assert len(cells) > 20
    module = None
    missing = []
    for cell in cells:
        for ref in (r.strip() for r in cell.split(",")):
            name, _, test = ref.partition("::")
            module = name or module  # "::test" continues the module named before it
            path = ROOT / "tests" / f"{module}.py"
            if not path.is_file():
                missing.append(ref)
                continue
            if test and not re.search(rf"^(async )?def {re.escape(test)}\(", path.read_text(), re.M):
                missing.append(ref)
    assert missing == [], missing
