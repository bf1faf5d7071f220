"""``keyedconsumer docs module:app``: write the AsyncAPI 3.0 document of a KeyedApp's routes."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Annotated, Any

import typer

from ..app import KeyedApp
from . import asyncapi
from .errors import CliError
from .handler import load_handler
from .output import _reports_errors


@_reports_errors
def docs(
    app_spec: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:APP",
            help="The KeyedApp, package.module:app, as `run` takes it.",
            show_default=False,
        ),
    ],
    out: Annotated[
        pathlib.Path | None,
        typer.Option(
            "--out", "-o", metavar="FILE", help="Write the document to FILE (default: standard output)."
        ),
    ] = None,
    fmt: Annotated[
        str,
        typer.Option("--format", metavar="FORMAT", help="json, or yaml (needs PyYAML)."),
    ] = "json",
    title: Annotated[
        str | None,
        typer.Option(
            "--title", metavar="TEXT", help="info.title (default: the module:app given).", show_default=False
        ),
    ] = None,
    app_version: Annotated[
        str,
        typer.Option("--app-version", metavar="VERSION", help="info.version: the version of your service."),
    ] = "0.0.0",
    app_dir: Annotated[
        str,
        typer.Option("--app-dir", metavar="DIR", help="Directory put first on sys.path before importing."),
    ] = ".",
) -> None:
    """Write the AsyncAPI 3.0 document of a KeyedApp: its topics, payload schemas (from Typed
    models), dead-letter, audit and result topics, and consumer groups; the module's docstring is
    info.description. Exit code 2 when the app cannot be imported or is not a KeyedApp."""
    if fmt not in ("json", "yaml"):
        raise CliError(f"--format must be json or yaml, got {fmt!r}", 2)
    app = load_handler(app_spec, app_dir)
    if not isinstance(app, KeyedApp):
        raise CliError(f"{app_spec!r} is not a KeyedApp: `docs` describes an app's routes", 2)
    try:
        module = sys.modules.get(app_spec.partition(":")[0])
        description = (module.__doc__ or "").strip() if module is not None else ""
        doc = asyncapi.document(
            app, title=title or app_spec, version=app_version, description=description or None
        )
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    text = _dump(doc, fmt)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)


def _dump(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise CliError(
            "--format yaml needs PyYAML (pip install pyyaml); --format json needs nothing", 2
        ) from None
    return str(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
