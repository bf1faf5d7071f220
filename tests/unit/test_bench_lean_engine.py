"""`bench/lean_engine.py`'s lean pass is a floor only if it keeps the guarantees: driven here with
outcomes in a random order, it runs a key's messages one at a time in offset order, and never
stores an offset past an unfinished message. Its report runs (no speed is asserted)."""

from __future__ import annotations

import importlib.util
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keyedconsumer.message import Message

ROOT = Path(__file__).resolve().parents[2]


def _lean(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (for its `import engine_cpu`; undone after)
    spec = importlib.util.spec_from_file_location("lean_engine", ROOT / "bench" / "lean_engine.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(20))
def test_the_lean_pass_keeps_key_order_and_the_first_unfinished_offset(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(seed)
    lean = _lean(monkeypatch).LeanEngine(2)
    msgs = [Message("t", i % 2, i // 2, b"k%d" % rnd.randrange(5), b"") for i in range(400)]
    running: list[Message] = []
    ran: dict[tuple[int, bytes | None], list[int]] = {}
    finished: set[tuple[int, int]] = set()
    admitted = 0
    while admitted < len(msgs) or lean.ready or running:
        if admitted < len(msgs) and rnd.random() < 0.3:
            lean.admit(msgs[admitted : admitted + 7])
            admitted = min(len(msgs), admitted + 7)
        for m in lean.take(rnd.randrange(1, 4)):
            assert all((r.partition, r.key) != (m.partition, m.key) for r in running), (
                "two of one key at once"
            )
            ran.setdefault((m.partition, m.key), []).append(m.offset)
            running.append(m)
        if running and rnd.random() < 0.7:
            m = running.pop(rnd.randrange(len(running)))
            lean.finish(m)
            finished.add((m.partition, m.offset))
        for p in range(2):  # the offset to store is never past an unfinished admitted message
            admitted_p = [m.offset for m in msgs[:admitted] if m.partition == p]
            unfinished = [o for o in admitted_p if (p, o) not in finished]
            if unfinished:
                assert lean.store_at[p] <= min(unfinished)
    for lid, offsets in ran.items():
        assert offsets == sorted(offsets), f"{lid} ran out of order"
    assert sum(len(o) for o in ran.values()) == len(msgs)
    assert lean.store_at == [200, 200] and not lean.lanes


@pytest.mark.timeout(120)
def test_the_lean_engine_report_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lean_engine.py"), "--messages", "20000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"engine / lean: [\d.]+x", proc.stdout), proc.stdout
