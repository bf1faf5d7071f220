"""Dead letters as library code: the replay marker (:mod:`.marker`), the failure headers
(:mod:`.records`), where a replay may send a record (:mod:`.targets`) and the replay itself
(:mod:`.replay`). The faces (``keyedconsumer dead-letter replay``, the dashboard) are built on these
and never on each other."""

from __future__ import annotations

import importlib
from typing import Any

from .marker import MAX_MARKER_CHARS, ReplayMarker, marker_group_of

#: The names of the modules that read and write Kafka (they load librdkafka), imported on first use
#: (PEP 562), so that importing the package for its marker (the command line does) loads none.
_LAZY = {
    "Failure": "records",
    "MAX_SELECTED": "replay",
    "ReplayJob": "replay",
    "plan_selected": "replay",
    "replay_selected": "replay",
    "run_replay": "replay",
    "Planner": "targets",
    "ReplayTargets": "targets",
    "Target": "targets",
    "allowed_topics": "targets",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


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
