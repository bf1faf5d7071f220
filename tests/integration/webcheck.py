"""What a dashboard page may contain, whatever the data: the templates' own elements and attributes
only (a value that became markup would add others), one script (the package's), and no 500."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[2] / "keyedconsumer" / "web" / "templates"
_SOURCE = "\n".join(p.read_text() for p in TEMPLATES.glob("*.html"))
#: The elements the templates write.
TAGS = frozenset(re.findall(r"<([a-z][a-z0-9]*)", _SOURCE))
#: The attributes they write (with a value, and those written bare).
ATTRIBUTES = frozenset(a.lower() for a in re.findall(r"[\s\"}]([a-zA-Z][a-zA-Z0-9-]*)=", _SOURCE)) | {
    "selected",
    "checked",
    "open",
    "hidden",
    "defer",
    "data-hex",
    "data-kafka-down",
    "data-redis-down",
    "aria-current",
}


class _Structure(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.problems: list[str] = []
        self.scripts: list[list[tuple[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in TAGS:
            self.problems.append(f"element <{tag}>")
        for name, value in attrs:
            if name not in ATTRIBUTES:
                self.problems.append(f"attribute {name}= on <{tag}>")
            if name in ("href", "src", "action") and value and re.match(r"\s*[a-z]+:", value, re.I):
                self.problems.append(f"{name}={value!r}: another scheme or origin")
        if tag == "script":
            self.scripts.append(attrs)


def structure_problems(html: str) -> list[str]:
    """What in ``html`` no template writes: elements, attributes, links to another scheme or origin, a
    script other than ``/static/app.js``."""
    parser = _Structure()
    parser.feed(html)
    parser.close()
    problems = parser.problems
    problems += [
        f"script {attrs}" for attrs in parser.scripts if attrs != [("src", "/static/app.js"), ("defer", None)]
    ]
    return problems
