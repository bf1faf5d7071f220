"""Importing the handler named on the command line."""

from __future__ import annotations

import importlib
import inspect as pyinspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..app import KeyedApp
from .errors import CliError

log = logging.getLogger("keyedconsumer.cli")


def load_handler(spec: str, app_dir: str | None = ".") -> Callable[..., Any]:
    """Import the handler named by ``spec``, ``package.module:function`` (``module:obj.attr`` also).

    Parameters
    ----------
    spec:
        Module path, a colon, and the attribute path of a callable (function, ``async def`` function,
        or an object with ``__call__``).
    app_dir:
        Directory put first on ``sys.path`` before importing (default: the working directory).

    Returns
    -------
    The callable, or a :class:`~keyedconsumer.KeyedApp` (``module:app``).

    Raises
    ------
    CliError
        (exit code 2) A malformed spec, a module that cannot be found or fails while importing, a
        missing attribute, a class, or something not callable.
    """
    module_name, sep, attr = spec.partition(":")
    dotted_ok = all(p.isidentifier() for p in module_name.split(".")) and all(
        p.isidentifier() for p in attr.split(".")
    )
    if not sep or not dotted_ok:
        raise CliError(f"invalid handler {spec!r}: expected 'package.module:function'", 2)
    if app_dir is not None:
        path = os.path.abspath(app_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CliError(
                f"cannot import handler module {module_name!r}: no module named {exc.name!r}", 2
            ) from None
        log.debug("importing %s failed", module_name, exc_info=True)
        raise CliError(
            f"importing handler module {module_name!r} failed: {type(exc).__name__}: {exc}", 2
        ) from None
    except (Exception, SystemExit) as exc:
        log.debug("importing %s failed", module_name, exc_info=True)
        raise CliError(
            f"importing handler module {module_name!r} failed: {type(exc).__name__}: {exc}", 2
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"module {module_name!r} has no attribute {attr!r}", 2) from None
    if isinstance(obj, KeyedApp):  # keyedconsumer run module:app
        return obj  # type: ignore[return-value]
    if pyinspect.isclass(obj):
        raise CliError(f"handler {spec!r} is a class: give a function or an instance with __call__", 2)
    if not callable(obj):
        raise CliError(f"handler {spec!r} is not callable (it is a {type(obj).__name__})", 2)
    return obj  # type: ignore[no-any-return]
