"""Sync or async: a middleware returns a handler of the same kind as the one it wraps."""

from __future__ import annotations

import inspect
from typing import Any


def is_async(handler: Any) -> bool:
    """True for ``async def`` handlers (functions or objects with an ``async def __call__``)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)
