"""The ``keyedconsumer`` command: run a handler, inspect a consumer group, replay dead letters.

::

    keyedconsumer run app.handlers:handle --topic orders --group orders-processor --concurrency 64
    keyedconsumer inspect --group orders-processor [--topic orders] [--redis URL] [--json]
    keyedconsumer dead-letter replay --from orders.dlq [--to orders] [--key K] [--since TIME] [--dry-run]
    keyedconsumer web [--group G] [--redis URL] [--enable-actions]   (extra keyedconsumer[web])
    keyedconsumer audit [--topic keyedconsumer.audit] [--key K] [--source-topic T --partition P --offset N] [--since TIME]

**Settings** come from, highest precedence first: command-line flags (one for every
``ConsumerConfig`` field and Redis sequencer option), environment variables ``KEYEDCONSUMER_<SETTING>``
(``KEYEDCONSUMER_CONCURRENCY=64``, ``KEYEDCONSUMER_BROKERS=a:9092,b:9092``,
``KEYEDCONSUMER_CONFIG='{"security.protocol": "SASL_SSL"}'``, ``KEYEDCONSUMER_SEQUENCER__LEASE_TTL_S=20``),
the TOML file given with ``--config`` (or ``KEYEDCONSUMER_CONFIG_FILE``), then the defaults: the
sources of pydantic-settings, merged by it (:mod:`.layers`). librdkafka properties (``-X key=value``,
the ``KEYEDCONSUMER_CONFIG`` JSON object, the TOML ``[config]`` table) and the sequencer's options
(``[sequencer]``) merge property by property. ``--group`` (``group``) sets the consumer's ``name``
and ``group_id`` within its layer (``--group`` beats ``KEYEDCONSUMER_GROUP_ID``). For
``run module:app`` they are defaults under the routes' own options.

**Exit codes**: 0 done (``run``: stopped by SIGTERM/SIGINT), 1 a failure at run time (a message
failed and nothing handled it, the brokers did not answer, a replay left records behind), 2 bad
input (an option, a setting, the handler). Errors are one line on stderr, without a traceback;
secret values (``-X`` properties whose name holds ``password``, ``secret``, ``token`` ...; the
password of a ``--redis`` URL) never appear in the output.
"""

from __future__ import annotations

import typer

from ..deadletters import ReplayMarker
from . import audit, inspect, replay, run, web
from .handler import load_handler
from .layers import RunOptions
from .replay import parse_since

__all__ = ["main", "app", "load_handler", "ReplayMarker", "parse_since", "RunOptions"]

app = typer.Typer(
    name="keyedconsumer",
    help="Run a keyed Kafka consumer, inspect a consumer group, replay dead-lettered records, read the audit trail.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
dead_letter_app = typer.Typer(help="Dead-letter topics.", no_args_is_help=True)
app.add_typer(dead_letter_app, name="dead-letter")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"keyedconsumer {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Run a keyed Kafka consumer, inspect a consumer group, replay dead letters, read the audit trail."""


app.command()(run.run)
app.command("inspect")(inspect.inspect_group)
app.command("web")(web.web)
dead_letter_app.command("replay")(replay.replay)
app.command("audit")(audit.audit)


def main() -> None:
    """The ``keyedconsumer`` console script (``python -m keyedconsumer`` too)."""
    app(prog_name="keyedconsumer")
