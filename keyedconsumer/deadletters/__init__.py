"""Dead letters as library code: the replay marker (:mod:`.marker`), the failure headers
(:mod:`.records`), where a replay may send a record (:mod:`.targets`) and the replay itself
(:mod:`.replay`). The faces (``keyedconsumer dead-letter replay``, the dashboard) are built on these
and never on each other."""

from __future__ import annotations

from .marker import MAX_MARKER_CHARS, ReplayMarker, marker_group_of
from .records import Failure
from .replay import MAX_SELECTED, ReplayJob, plan_selected, replay_selected, run_replay
from .targets import Planner, ReplayTargets, Target, allowed_topics

__all__ = [
    "MAX_MARKER_CHARS",
    "MAX_SELECTED",
    "Failure",
    "Planner",
    "ReplayJob",
    "ReplayMarker",
    "ReplayTargets",
    "Target",
    "allowed_topics",
    "marker_group_of",
    "plan_selected",
    "replay_selected",
    "run_replay",
]
