"""The dashboard's actions: replay selected dead letters (after a person confirmed where each goes),
un-park a key, cancel a scheduled message. Each needs a signed-in session with its CSRF token, or
the token as a bearer credential (:mod:`.auth`); each is logged to ``keyedconsumer.web.actions`` and,
with an audit topic, written to it (:mod:`keyedconsumer.action_audit`).

A replay is two requests: ``/actions/replay-plan`` says where each selected record would go (the
topic its header names only if allowed, the key's partition now: :mod:`keyedconsumer.deadletters`),
which the page shows for confirmation; ``/actions/replay`` then sends them, each only to the target
the person confirmed (a record whose target changed meanwhile is left pending, and the answer says so).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..action_audit import ActionAudit, Sent, action_records, replay_fields
from ..deadletters import ReplayTargets, allowed_topics, plan_selected, replay_selected
from ..errors import KafkaClientError, PublishError
from ..sequencing import cancel_scheduled, unpark_now
from ..sequencing.keys import key_of
from .auth import COOKIE, Guard
from .deadletters import DeadLetterReader
from .sampler import Sampler

__all__ = ["Actions", "ReplayScope"]

#: One record per action (who, what, the outcome): the audit log.
actions_log = logging.getLogger("keyedconsumer.web.actions")

#: What an action's run returns: ``(ok, message for the page, the audit record's fields (``key``: the
#: message key as bytes), [(key, fields)] of one more record each (the dead letters a replay sent))``.
_Result = tuple[bool, str, dict[str, Any], list[Sent]]


class ReplayScope:
    """Where the dashboard's replays may go: the topics ``groups`` consume (asked at each replay) and
    ``topics``; the producers' ``partitioner``; ``repartitioned`` as the CLI's ``--repartitioned``."""

    def __init__(
        self,
        conf: dict[str, Any],
        groups: list[str],
        topics: list[str],
        partitioner: str,
        repartitioned: bool,
        timeout_s: float,
    ) -> None:
        self.conf, self.consumer_groups, self.listed_topics = conf, list(groups), list(topics)
        self.partitioner, self.repartitioned, self.timeout_s = partitioner, repartitioned, timeout_s
        ReplayTargets(partitioner=partitioner)  # an unknown partitioner fails here, at start

    def targets(self) -> ReplayTargets:
        """The targets allowed now.

        Raises
        ------
        ValueError
            Neither groups nor topics were given (the answer says how to start the dashboard).
        KafkaClientError
            The brokers did not answer.
        """
        if not self.consumer_groups and not self.listed_topics:
            raise ValueError(
                "no replay target is allowed: start the dashboard with --group (the consumer groups whose "
                "dead letters these are) or --allow-topic"
            )
        allowed, because = allowed_topics(self.conf, self.consumer_groups, self.listed_topics, self.timeout_s)
        return ReplayTargets(
            allowed=allowed, because=because, partitioner=self.partitioner, repartitioned=self.repartitioned
        )


class Actions:
    """The action routes, on the dashboard's guard, sampler, dead-letter reader and audit."""

    def __init__(
        self,
        conf: dict[str, Any],
        guard: Guard,
        sampler: Sampler,
        dead_letters: DeadLetterReader,
        scope: ReplayScope,
        audit: ActionAudit | None,
        redis_url: str | None,
        timeout_s: float,
    ) -> None:
        self.conf, self.guard, self.sampler, self.dead_letters = conf, guard, sampler, dead_letters
        self.scope, self.audit, self.redis_url, self.timeout_s = scope, audit, redis_url, timeout_s

    # -- the routes -------------------------------------------------------------------------------

    async def replay_plan(self, request: Request) -> Response:
        """Where each selected record would go (no audit record: nothing happens)."""
        refused = self._refused(request, "replay-plan")
        if refused is not None:
            return refused
        try:
            body = await _body(request)
            topic, records = self._selection(body)
            plan = await run_in_threadpool(
                plan_selected,
                self.conf,
                topic,
                records,
                self.scope.targets(),
                timeout_s=self._replay_timeout_s,
            )
        except (KeyError, TypeError, ValueError) as exc:
            return JSONResponse({"ok": False, "message": f"bad request: {exc}"}, 400)
        except KafkaClientError as exc:
            return JSONResponse({"ok": False, "message": str(exc)}, 409)
        return JSONResponse({"ok": True, "topic": topic, "plan": plan})

    async def replay(self, request: Request) -> Response:
        return await self._action(request, "replay", self._replay)

    async def unpark(self, request: Request) -> Response:
        return await self._action(request, "unpark", self._unpark)

    async def cancel(self, request: Request) -> Response:
        return await self._action(request, "cancel-scheduled", self._cancel)

    # -- the frame of every action ----------------------------------------------------------------

    @property
    def _replay_timeout_s(self) -> float:
        return max(30.0, self.timeout_s)

    def _refused(self, request: Request, name: str) -> Response | None:
        if not self.guard.enabled:
            return JSONResponse(
                {"ok": False, "message": "actions are off (start with --enable-actions)"}, 403
            )
        sid, authorization = request.cookies.get(COOKIE), request.headers.get("authorization")
        if not self.guard.allowed(sid, request.headers.get("x-csrf-token"), authorization):
            actions_log.warning(
                "action %s refused from %s: not signed in or no CSRF token", name, _client(request)
            )
            return JSONResponse({"ok": False, "message": "sign in with the access token first"}, 403)
        return None

    async def _action(
        self, request: Request, name: str, run: Callable[[dict[str, Any]], _Result]
    ) -> Response:
        refused = self._refused(request, name)
        if refused is not None:
            return refused
        client = _client(request)
        who = self.guard.who(request.cookies.get(COOKIE), request.headers.get("authorization"))
        body: dict[str, Any] = {}
        try:
            body = await _body(request)
            ok, message, fields, sent = await run_in_threadpool(run, body)
            result, status = ("done", 200) if ok else ("failed", 409)
        except (KeyError, TypeError, ValueError) as exc:
            ok, message, fields, sent = False, f"bad request: {exc}", _asked(body), []
            result, status = "bad request", 400
        except (KafkaClientError, PublishError) as exc:
            ok, message, fields, sent = False, str(exc), _asked(body), []
            result, status = "failed", 409
        except Exception as exc:  # StoreUnavailable: Redis did not answer
            ok, message, fields, sent = False, f"{type(exc).__name__}: {exc}", _asked(body), []
            result, status = "failed", 409
        actions_log.info("action %s by %s from %s: %s (%s)", name, who, client, message, result)
        if self.audit is not None:
            records = action_records(name, who, client, result, message, fields, sent)
            problem = await run_in_threadpool(self.audit.write, records)
            if problem is not None:
                message += f" (NOT in the audit trail: {problem})"
        if status != 400:
            self.sampler.refresh_soon()
        return JSONResponse({"ok": ok, "message": message}, status)

    # -- each action ------------------------------------------------------------------------------

    def _selection(self, body: dict[str, Any]) -> tuple[str, set[tuple[int, int]]]:
        topic = str(body["topic"])
        if topic not in self.sampler.snapshot().dead_letter_topics:
            raise ValueError(f"{topic[:200]!r} is not a dead-letter topic shown here")
        return topic, {(int(p), int(o)) for p, o in body["records"]}

    def _replay(self, body: dict[str, Any]) -> _Result:
        topic, records = self._selection(body)
        if "targets" not in body:
            raise ValueError(
                "give the targets confirmed: [[partition, offset, topic, partition], ...] "
                "as /actions/replay-plan answered them"
            )
        expected = {
            (int(p), int(o)): (str(t), None if part is None else int(part))
            for p, o, t, part in body["targets"]
        }
        result = replay_selected(
            self.conf,
            topic,
            records,
            self.scope.targets(),
            expected=expected,
            timeout_s=self._replay_timeout_s,
        )
        self.dead_letters.forget(topic)
        where = ", ".join(
            f"{r['dlq_partition']}@{r['dlq_offset']} -> {r['topic']}[{r['partition']}]@{r['offset']}"
            for r in result["records"][:20]
        )
        not_sent = "; ".join(
            f"{r['dlq_partition']}@{r['dlq_offset']} not sent: {r['reason']}" for r in result["refused"][:5]
        )
        message = (
            f"{topic}: replayed {result['sent']} of {len(records)} selected"
            + (f" ({where})" if where else "")
            + (f"; already replayed {result['already_replayed']}" if result["already_replayed"] else "")
            + (f"; left pending {result['no_target']}: {not_sent}" if result["no_target"] else "")
            + (f"; error: {result['error']}" if result["error"] else "")
        )
        fields, sent = replay_fields(topic, records, result)
        return result["error"] is None and result["sent"] > 0, message, fields, sent

    def _redis_target(self, body: dict[str, Any]) -> tuple[str, str]:
        if not self.redis_url:
            raise ValueError("no Redis sequencer (start with --redis)")
        ns = str(body["namespace"])
        if ns not in self.sampler.snapshot().redis:
            raise ValueError(f"namespace {ns[:200]!r} is not shown here")
        return self.redis_url, ns

    def _unpark(self, body: dict[str, Any]) -> _Result:
        url, ns = self._redis_target(body)
        lid = str(body["lid"])
        ok = unpark_now(url, ns, lid)
        fields: dict[str, Any] = {"namespace": ns, "lid": lid, "key": key_of(lid)}
        if lid.startswith("p."):  # a partition's lease: its topic and partition
            _, topic_hex, part = lid.split(".", 2)
            fields.update(topic=bytes.fromhex(topic_hex).decode(errors="replace"), partition=int(part))
        return ok, f"{ns}: key {lid} due now" if ok else f"{ns}: key {lid} has no parked messages", fields, []

    def _cancel(self, body: dict[str, Any]) -> _Result:
        url, ns = self._redis_target(body)
        sid = str(body["id"])
        ok = cancel_scheduled(url, ns, sid)
        shown: dict[str, Any] = next(
            (
                m
                for m in self.sampler.snapshot().redis[ns].get("scheduled_messages", [])
                if m.get("id") == sid
            ),
            {},
        )
        fields = {
            "namespace": ns,
            "scheduled_id": sid,
            "topic": shown.get("topic"),
            "key": None if shown.get("key") is None else str(shown["key"]).encode(),
        }
        return (
            ok,
            f"{ns}: scheduled message {sid} cancelled" if ok else f"{ns}: {sid} is not scheduled (any more)",
            fields,
            [],
        )


async def _body(request: Request) -> dict[str, Any]:
    body = json.loads((await request.body())[: 1 << 20] or b"{}")
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    return body


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _asked(body: dict[str, Any]) -> dict[str, Any]:
    """What a request that could not run asked for, for its audit record (each value cut to 200 characters)."""
    names = {"namespace": "namespace", "lid": "lid", "id": "scheduled_id", "topic": "dlq_topic"}
    return {field: str(body[k])[:200] for k, field in names.items() if k in body}
