"""Two consumers of two topics (two groups) in one process, stopped by one SIGTERM.

    python -m tests.integration.procs.two_consumers MODE BOOTSTRAP TOPIC1 GROUP1 TOPIC2 GROUP2 N

``MODE`` ``threads``: the first consumer's ``run()`` in the main thread, the second's in another
thread; ``async``: ``asyncio.gather(c1.run_async(), c2.run_async())`` with ``async def`` handlers.
Prints ``consumed GROUP`` once a consumer has handled ``N`` messages, and ``returned`` once both
``run()`` / ``run_async()`` calls returned; exits 0 then (1 if either raised). ``app``: one
``KeyedApp`` with an ``async def`` route per topic (group = route name), whose startup and shutdown
hooks print ``startup`` and ``shutdown``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

from keyedconsumer import KeyedApp, KeyedConsumer, Message


def main() -> int:
    mode, bootstrap, topic1, group1, topic2, group2, n_text = sys.argv[1:8]
    n = int(n_text)
    lock = threading.Lock()

    def counter(group: str) -> Any:
        seen = [0]

        def count(msg: Message) -> None:
            with lock:
                seen[0] += 1
                if seen[0] == n:
                    print(f"consumed {group}", flush=True)

        if mode == "async":

            async def handle(msg: Message) -> None:
                await asyncio.sleep(0)
                count(msg)

            return handle
        return count

    def consumer(topic: str, group: str) -> KeyedConsumer:
        return KeyedConsumer(
            name=group,
            handler=counter(group),
            brokers=[bootstrap],
            topics=[topic],
            concurrency=4,
            config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000},
        )

    errors: list[BaseException] = []
    if mode == "app":
        app = KeyedApp(
            brokers=[bootstrap],
            concurrency=4,
            config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000},
        )
        app.on_startup(lambda: print("startup", flush=True))
        app.on_shutdown(lambda: print("shutdown", flush=True))
        app.handler(topic1, name=group1)(counter(group1))
        app.handler(topic2, name=group2)(counter(group2))
        try:
            app.run()
        except BaseException as exc:
            errors.append(exc)
        print("returned", *(repr(e) for e in errors), flush=True)
        return 1 if errors else 0
    c1, c2 = consumer(topic1, group1), consumer(topic2, group2)
    if mode == "threads":

        def run_second() -> None:
            try:
                c2.run()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run_second, name="second-consumer")
        t.start()
        try:
            c1.run()
        except BaseException as exc:
            errors.append(exc)
        t.join()
    else:

        async def both() -> None:
            for result in await asyncio.gather(c1.run_async(), c2.run_async(), return_exceptions=True):
                if isinstance(result, BaseException):
                    errors.append(result)

        asyncio.run(both())
    print("returned", *(repr(e) for e in errors), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
