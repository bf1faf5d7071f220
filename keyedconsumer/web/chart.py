"""A throughput chart as SVG polyline points (drawn by the template, no script, no library)."""

from __future__ import annotations

import dataclasses

__all__ = ["Chart", "throughput_chart"]


@dataclasses.dataclass(frozen=True)
class Chart:
    """Two lines in a ``width`` x ``height`` box: ``consumed`` and ``produced`` (polyline points),
    the rate at the top of the scale and the seconds the chart spans."""

    width: int
    height: int
    consumed: str
    produced: str
    top: float
    span_s: float
    last_consumed: float
    last_produced: float


def throughput_chart(
    history: list[tuple[float, float, float]], width: int = 320, height: int = 64
) -> Chart | None:
    """The chart of ``(time s, consumed/s, produced/s)`` samples; ``None`` with fewer than two."""
    if len(history) < 2:
        return None
    t0, t1 = history[0][0], history[-1][0]
    span = max(t1 - t0, 1e-3)
    top = max(1.0, max(max(c, p) for _, c, p in history))

    def line(index: int) -> str:
        pts = []
        for row in history:
            x = (row[0] - t0) / span * width
            y = height - row[index] / top * (height - 2) - 1
            pts.append(f"{x:.1f},{y:.1f}")
        return " ".join(pts)

    return Chart(width, height, line(1), line(2), top, span, history[-1][1], history[-1][2])
