"""The README's first service, as printed: its files, taken from the README's fenced code blocks.

A block is a file when its first line is a comment naming it: ```` ```python ```` then
``# orders.py: ...``. Used by ``tests/unit/test_readme.py`` (in memory, no network) and
``tests/integration/test_readme_service.py`` (the real broker).
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: The files of the first service, in the order the README shows them.
FILES = ("orders.py", "make_orders.py", "test_orders.py")
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def blocks() -> list[tuple[str, str]]:
    """``[(language, code)]`` of every fenced block of the README, in order."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(README.read_text())]


def first_service() -> dict[str, str]:
    """``{file name: code}`` of the README's python blocks that name a file of :data:`FILES`.

    Raises
    ------
    AssertionError
        A file is missing, or named by two blocks.
    """
    found: dict[str, str] = {}
    for lang, code in blocks():
        m = re.match(r"# ([\w.]+\.py)\b", code)
        if lang == "python" and m and m.group(1) in FILES:
            assert m.group(1) not in found, f"the README has two blocks for {m.group(1)}"
            found[m.group(1)] = code
    assert set(found) == set(FILES), f"the README lacks {sorted(set(FILES) - set(found))}"
    return found


def write_first_service(folder: Path) -> Path:
    """Write the first service's files into ``folder``, exactly as printed; returns ``folder``."""
    for name, code in first_service().items():
        (folder / name).write_text(code)
    return folder


def commands(marker: str) -> list[str]:
    """The command lines of the README's bash blocks that start with ``marker`` (comments cut)."""
    out = []
    for lang, code in blocks():
        if lang == "bash":
            for line in code.splitlines():
                if line.startswith(marker):
                    out.append(line.split("  #")[0].split(" #")[0].strip())
    return out
