"""The ``keyedconsumer`` command: run a handler, inspect a consumer group, replay dead letters.

::

    keyedconsumer run app.handlers:handle --topic orders --group orders-processor --concurrency 64
    keyedconsumer inspect --group orders-processor [--topic orders] [--redis URL] [--json]
    keyedconsumer dead-letter replay --from orders.dlq [--to orders] [--key K] [--since TIME] [--dry-run]
    keyedconsumer web [--group G] [--redis URL] [--enable-actions]   (extra keyedconsumer[web])
    keyedconsumer audit [--topic keyedconsumer.audit] [--key K] [--source-topic T --partition P --offset N] [--since TIME]
    keyedconsumer docs module:app [--out asyncapi.json] [--format json|yaml]   (AsyncAPI 3.0)

**Settings** come from, highest precedence first: command-line flags (one for every
``ConsumerConfig`` field and Redis sequencer option), environment variables ``KEYEDCONSUMER_<SETTING>``
(``KEYEDCONSUMER_CONCURRENCY=64``, ``KEYEDCONSUMER_BROKERS=a:9092,b:9092``,
``KEYEDCONSUMER_CONFIG='{"security.protocol": "SASL_SSL"}'``, ``KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S=20``),
the TOML file given with ``--config`` (or ``KEYEDCONSUMER_CONFIG_FILE``), then the defaults: the
sources of pydantic-settings, merged by it (:mod:`.layers`). librdkafka properties (``-X key=value``,
the ``KEYEDCONSUMER_CONFIG`` JSON object, the TOML ``[config]`` table) and the sequencer's options
(``[sequencer]``) merge property by property. ``--group`` (``group``) sets the consumer's ``name``
and ``group_id`` within its layer (``--group`` beats ``KEYEDCONSUMER_GROUP_ID``). For
``run module:app`` they go over the app's own options (``KeyedApp(brokers=...)``) and under each
route's own (``@app.handler(..., concurrency=16)``).

**Exit codes**: 0 done (``run``, ``web``: stopped by SIGTERM/SIGINT), 1 a failure at run time (a message
failed and nothing handled it, the brokers did not answer, a replay left records behind), 2 bad
input (an option, a setting, the handler). Errors are one line on stderr, without a traceback (a
JSON log record with ``--log-format json``);
secret values (``-X`` properties whose name holds ``password``, ``secret``, ``token`` ...; the
password of a ``--redis`` URL) never appear in the output.
"""

from __future__ import annotations

import typer

from .. import __version__
from ..deadletters.marker import ReplayMarker
from . import audit, docs, inspect, replay, run, web
from .handler import load_handler
from .help import Command, Group
from .layers import RunOptions
from .replay import parse_since

__all__ = ["main", "app", "load_handler", "ReplayMarker", "parse_since", "RunOptions"]

app = typer.Typer(
    name="keyedconsumer",
    help="Run a keyed Kafka consumer, inspect a consumer group, replay dead-lettered records, read the audit trail.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, options in sections (.help)
    cls=Group,
)
dead_letter_app = typer.Typer(help="Dead-letter topics.", no_args_is_help=True, cls=Group)
app.add_typer(dead_letter_app, name="dead-letter")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"keyedconsumer {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Run a keyed Kafka consumer, inspect a consumer group, replay dead letters, read the audit trail."""


# short_help: whole sentences in the list of commands (click would cut the docstring's first one)
app.command(cls=Command, short_help="Consume topics with a handler until SIGTERM or SIGINT.")(run.run)
app.command("inspect", cls=Command, short_help="Show a consumer group's offsets and lag per partition.")(
    inspect.inspect_group
)
app.command("web", cls=Command, short_help="Serve the operations dashboard.")(web.web)
dead_letter_app.command("replay", cls=Command, short_help="Re-publish dead-lettered records.")(replay.replay)
app.command("audit", cls=Command, short_help="Find what happened to messages in the audit trail.")(
    audit.audit
)
app.command("docs", cls=Command, short_help="Write the AsyncAPI document of an app's routes.")(docs.docs)


def main() -> None:
    """The ``keyedconsumer`` console script (``python -m keyedconsumer`` too)."""
    app(prog_name="keyedconsumer")
