"""The dashboard's ASGI application (Starlette): pages, their live fragments, sign-in, actions.

Pages are rendered on the server by Jinja2 with autoescaping on: a dead letter's key, value and
headers are attacker-controlled and only ever reach the page escaped. Every response carries a
Content-Security-Policy that allows no inline script and nothing from another origin. Each page
refreshes its live part by fetching ``?fragment=1`` of itself every few seconds (``static/app.js``);
the data comes from the :class:`~keyedconsumer.web.sampler.Sampler`'s latest snapshot, so open pages
add no load on the brokers or Redis (dead letters are read on demand, cached a few seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..action_audit import ActionAudit
from ..errors import KafkaClientError
from ..formatting import TIME_FORMS, age, parse_time
from ..kafka.partitioners import DEFAULT_PARTITIONER
from ..sequencing import redact_url
from .actions import Actions, ReplayScope, actions_log
from .auth import COOKIE, Guard
from .chart import throughput_chart
from .deadletters import MAX_SHOWN_BYTES, DeadLetterReader, Filters
from .hosts import allowed_hosts
from .sampler import Sampler

__all__ = ["WebOptions", "create_app"]

log = logging.getLogger("keyedconsumer.web")

_HERE = Path(__file__).parent
PAGE_ROWS = 100
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclasses.dataclass
class WebOptions:
    """What the dashboard shows and allows.

    ``conf``: librdkafka properties; ``groups``, ``namespaces``, ``dead_letter_topics``: as
    :class:`~keyedconsumer.web.sampler.Sampler` takes them; ``actions``: enable the actions (needs
    ``token``); ``audit_topic``: write each action to this audit topic (the ``Audit`` middleware's,
    on the same brokers, :mod:`keyedconsumer.action_audit`), ``None``: to the log only;
    ``refresh_s``: seconds between a page's refreshes; ``interval_s``: between samples;
    ``timeout_s``: bound of one broker or Redis call, and of an audit record's write (seconds);
    ``allowed_hosts``: the host names (``Host`` header) the dashboard answers for, besides the
    loopback names :data:`~keyedconsumer.web.hosts.LOOPBACK_HOSTS` (:mod:`.hosts`; ``*.example.com``
    for subdomains); ``allow_topics``: the topics a replay may send a dead letter to besides those
    ``groups`` consume; ``partitioner``: the target topics' producers' partitioner (librdkafka's
    name); ``repartitioned``: send a record whose key's partition changed to its partition now.
    """

    conf: dict[str, Any]
    groups: list[str] = dataclasses.field(default_factory=list)
    redis_url: str | None = None
    namespaces: list[str] = dataclasses.field(default_factory=list)
    dead_letter_topics: list[str] = dataclasses.field(default_factory=list)
    actions: bool = False
    token: str | None = None
    audit_topic: str | None = None
    refresh_s: float = 5.0
    interval_s: float = 5.0
    stall_after_s: float = 60.0
    timeout_s: float = 10.0
    dead_letters_per_partition: int = 200
    allowed_hosts: list[str] = dataclasses.field(default_factory=list)
    allow_topics: list[str] = dataclasses.field(default_factory=list)
    partitioner: str = DEFAULT_PARTITIONER
    repartitioned: bool = False


def _when(epoch_s: float | None, now_s: float) -> str:
    if epoch_s is None:
        return "-"
    return f"in {age(epoch_s - now_s)}" if epoch_s >= now_s else f"{age(now_s - epoch_s)} ago"


def _page(items: list[Any], page: int, size: int = PAGE_ROWS) -> tuple[list[Any], int, int]:
    pages = max(1, math.ceil(len(items) / size))
    page = min(max(1, page), pages)
    return items[(page - 1) * size : page * size], page, pages


def _int_arg(request: Request, name: str, default: int = 1) -> int:
    try:
        return int(request.query_params.get(name, default))
    except ValueError:
        return default


class _Dashboard:
    """The routes' shared state: options, sampler, dead-letter reader, guard, templates."""

    def __init__(
        self, options: WebOptions, sampler: Sampler | None = None, audit: ActionAudit | None = None
    ) -> None:
        self.o = options
        self.audit = audit or (
            ActionAudit(options.conf, options.audit_topic, timeout_s=options.timeout_s)
            if options.audit_topic
            else None
        )
        self.sampler = sampler or Sampler(
            options.conf,
            groups=options.groups,
            redis_url=options.redis_url,
            namespaces=options.namespaces,
            dead_letter_topics=options.dead_letter_topics,
            interval_s=options.interval_s,
            timeout_s=options.timeout_s,
            stall_after_s=options.stall_after_s,
        )
        self.dead_letters = DeadLetterReader(
            options.conf,
            limit=options.dead_letters_per_partition,
            cache_s=options.interval_s,
            timeout_s=options.timeout_s,
        )
        self.guard = Guard(options.token if options.actions else None)
        scope = ReplayScope(
            options.conf,
            options.groups,
            options.allow_topics,
            options.partitioner,
            options.repartitioned,
            options.timeout_s,
        )
        self.actions = Actions(
            options.conf,
            self.guard,
            self.sampler,
            self.dead_letters,
            scope,
            self.audit,
            options.redis_url,
            options.timeout_s,
        )
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            autoescape=True,  # every value is escaped, whatever the template's name
            undefined=jinja2.StrictUndefined,
        )
        self.env.globals.update(
            age=age,
            when=_when,
            max_shown=MAX_SHOWN_BYTES,
            qs=lambda **kw: urlencode({k: v for k, v in kw.items() if v}),
        )

    # -- rendering --------------------------------------------------------------------------------

    def render(self, request: Request, template: str, nav: str, **context: Any) -> Response:
        fragment = request.query_params.get("fragment") == "1"
        sid = request.cookies.get(COOKIE)
        snap = self.sampler.snapshot()
        live = dict(request.query_params)
        live["fragment"] = "1"
        html = self.env.get_template(template).render(
            request_path=request.url.path,
            fragment=fragment,
            nav=nav,
            snap=snap,
            now_s=time.time(),
            refresh_ms=int(self.o.refresh_s * 1000),
            live_url=f"{request.url.path}?{urlencode(live)}",
            actions=self.guard.enabled,
            csrf=self.guard.csrf(sid),
            redis_on=bool(self.o.redis_url),
            redis_shown=redact_url(self.o.redis_url) if self.o.redis_url else None,
            brokers=self.o.conf.get("bootstrap.servers", ""),
            **context,
        )
        return HTMLResponse(html)

    # -- pages --------------------------------------------------------------------------------------

    async def groups(self, request: Request) -> Response:
        snap = self.sampler.snapshot()
        rows, page, pages = _page(
            sorted(snap.groups.values(), key=lambda g: g.group), _int_arg(request, "page")
        )
        charts = {g.group: throughput_chart(g.history) for g in rows}
        return self.render(request, "groups.html", "groups", rows=rows, page=page, pages=pages, charts=charts)

    async def group(self, request: Request) -> Response:
        name = request.path_params["group"]
        self.sampler.watch(name)
        g = self.sampler.snapshot().groups.get(name)
        if g is None or not g.detailed:
            return self.render(request, "missing.html", "groups", what=f"consumer group {name}")
        rows, page, pages = _page(g.rows, _int_arg(request, "page"))
        return self.render(
            request,
            "group.html",
            "groups",
            g=g,
            rows=rows,
            page=page,
            pages=pages,
            chart=throughput_chart(g.history),
        )

    async def keys(self, request: Request) -> Response:
        snap = self.sampler.snapshot()
        namespaces = sorted(snap.redis)
        ns = request.query_params.get("ns") or (namespaces[0] if namespaces else "")
        q = request.query_params.get("q", "").strip()
        info = snap.redis.get(ns, {})

        def hit(row: dict[str, Any]) -> bool:
            return not q or q.lower() in str(row.get("key") or "").lower()

        shown = {
            part: [r for r in info.get(part, []) if hit(r)][: PAGE_ROWS * 2]
            for part in ("leases", "parked", "scheduled_messages")
        }
        return self.render(
            request,
            "keys.html",
            "keys",
            namespaces=namespaces,
            ns=ns,
            q=q,
            info=info,
            shown=shown,
            redis_now_s=float(info.get("now_s") or time.time()),
        )

    async def dead_letter_topics(self, request: Request) -> Response:
        snap = self.sampler.snapshot()
        topics, page, pages = _page(snap.dead_letter_topics, _int_arg(request, "page"))
        return self.render(
            request, "dead_letters.html", "dead-letters", topics=topics, page=page, pages=pages
        )

    async def dead_letter_records(self, request: Request) -> Response:
        topic = request.path_params["topic"]
        args = request.query_params
        problems: list[str] = []

        def when(name: str) -> int | None:
            text = args.get(name, "").strip()
            if not text:
                return None
            try:
                return parse_time(text)
            except ValueError:
                problems.append(f"{name}: expected {TIME_FORMS}")
                return None

        filters = Filters(
            _key_filter(args.get("key", ""), args.get("key_hex", ""), problems),
            args.get("error", "").strip(),
            when("since"),
            when("until"),
        )
        error = None
        listing = None
        if topic not in self.sampler.snapshot().dead_letter_topics:  # only dead letters are read here
            error = f"{topic} is not a dead-letter topic shown here (deleted?)"
        else:
            try:
                listing = await run_in_threadpool(self.dead_letters.records, topic, filters)
            except KafkaClientError as exc:
                error = (
                    f"topic {topic} does not exist (deleted?)"
                    if exc.code == "UNKNOWN_TOPIC_OR_PART"
                    else str(exc)
                )
        rows, page, pages = _page(listing.rows if listing else [], _int_arg(request, "page"))
        return self.render(
            request,
            "dead_letter_records.html",
            "dead-letters",
            topic=topic,
            rows=rows,
            page=page,
            pages=pages,
            listing=listing,
            searched=filters.given,
            error=error,
            problems=problems,
            f={k: args.get(k, "") for k in ("key", "key_hex", "error", "since", "until")},
        )

    # -- sign-in ------------------------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        return self.render(request, "login.html", "login", failed=False)

    async def login(self, request: Request) -> Response:
        if not self.guard.enabled:
            return self.render(request, "login.html", "login", failed=False)
        form = parse_qs((await request.body())[:8192].decode("utf-8", "replace"))
        sid = self.guard.open((form.get("token") or [""])[0])
        if sid is None:
            actions_log.warning("sign-in refused from %s", request.client.host if request.client else "?")
            await asyncio.sleep(0.5)  # slows guessing
            return self.render(request, "login.html", "login", failed=True)
        actions_log.info("sign-in from %s", request.client.host if request.client else "?")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, sid, httponly=True, samesite="strict", path="/")
        return response

    async def logout(self, request: Request) -> Response:
        self.guard.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response


def _key_filter(text: str, hex_text: str, problems: list[str]) -> bytes | None:
    """The exact key to search for: ``key`` (its UTF-8 bytes) or ``key_hex`` (a binary key)."""
    if hex_text.strip():
        try:
            return bytes.fromhex(hex_text.strip())
        except ValueError:
            problems.append("key_hex: expected the key's bytes in hex (0-9, a-f)")
            return None
    return text.encode("utf-8", "surrogatepass") if text else None


def create_app(
    options: WebOptions,
    *,
    sampler: Sampler | None = None,
    start_sampler: bool = True,
    audit: ActionAudit | None = None,
) -> Starlette:
    """The dashboard's ASGI app.

    Parameters
    ----------
    options:
        What to show and allow.
    sampler:
        A sampler to read from (tests); by default one is built from ``options``.
    audit:
        Where the actions are written (tests); by default an :class:`~keyedconsumer.action_audit.ActionAudit`
        on ``options.audit_topic``, if given.
    start_sampler:
        Start the sampler's thread with the app (and stop it at shutdown).

    Raises
    ------
    ValueError
        Actions enabled without a token; an allowed host that is not a host name, pattern or
        address; an unknown partitioner.
    """
    if options.actions and not options.token:
        raise ValueError("actions need an access token")
    hosts = allowed_hosts(options.allowed_hosts)
    d = _Dashboard(options, sampler, audit)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if start_sampler:
            d.sampler.start()
        try:
            yield
        finally:
            if start_sampler:
                d.sampler.stop()
            if d.audit is not None:
                await run_in_threadpool(d.audit.close)

    async def home(request: Request) -> Response:
        return RedirectResponse("/groups", status_code=302)

    routes = [
        Route("/", home),
        Route("/groups", d.groups),
        Route("/groups/{group:path}", d.group),
        Route("/keys", d.keys),
        Route("/dead-letters", d.dead_letter_topics),
        Route("/dead-letters/{topic:path}", d.dead_letter_records),
        Route("/login", d.login_form, methods=["GET"]),
        Route("/login", d.login, methods=["POST"]),
        Route("/logout", d.logout, methods=["POST"]),
        Route("/actions/replay-plan", d.actions.replay_plan, methods=["POST"]),
        Route("/actions/replay", d.actions.replay, methods=["POST"]),
        Route("/actions/unpark", d.actions.unpark, methods=["POST"]),
        Route("/actions/cancel-scheduled", d.actions.cancel, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    # the Host check (a DNS-rebinding page gets 400), inside the security headers (so its answer has them)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)
    app.add_middleware(_SecurityHeaders)
    app.state.dashboard = d
    return app


class _SecurityHeaders:
    """Adds the Content-Security-Policy and friends to every response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", _CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"),
                    (b"cache-control", b"no-store"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
