"""Committed-offset sampler: the group's committed offsets every 250 ms, from an AdminClient.

    python -m tests.faults.sampler RUN_DIR

Appends ``sent_ns recv_ns p:offset,... p=metadata;...`` (the commit metadata of the partitions that
have one, or ``-``; or ``sent_ns recv_ns ERR name``) to ``commits.log`` until SIGTERM. A process of its own: librdkafka's admin client can abort the process on a request that
times out while the broker is down (``rd_kafka_enq_once_del_source_return`` assertion, seen with
librdkafka 2.16.0), and the orchestrator must survive that; it restarts this sampler. After a broker
restart an admin client can also keep failing every request: it is replaced after 3 failures.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from .common import load_json


def main() -> int:
    run_dir = Path(sys.argv[1])
    cfg = load_json(run_dir / "run.json")
    stop = False

    def on_term(_s: int, _f: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)

    def new_admin() -> AdminClient:
        return AdminClient(
            {
                "bootstrap.servers": cfg["bootstrap"],
                "log_level": 0,
                "socket.connection.setup.timeout.ms": 1000,
            }
        )

    admin = new_admin()
    failures = 0
    req = [
        ConsumerGroupTopicPartitions(
            cfg["group"], [TopicPartition(cfg["topic"], p) for p in range(cfg["partitions"])]
        )
    ]
    with open(run_dir / "commits.log", "a", buffering=1) as f:
        while not stop:
            t0 = time.monotonic()
            sent = time.monotonic_ns()
            try:
                res = admin.list_consumer_group_offsets(req, request_timeout=2.0)[cfg["group"]].result(3.0)
                got = {tp.partition: tp.offset for tp in res.topic_partitions if tp.offset >= 0}
                meta = {
                    tp.partition: tp.metadata for tp in res.topic_partitions if tp.offset >= 0 and tp.metadata
                }
                offsets = ",".join(f"{p}:{o}" for p, o in sorted(got.items())) or "-"
                metadata = ";".join(f"{p}={m}" for p, m in sorted(meta.items())) or "-"
                f.write(f"{sent} {time.monotonic_ns()} {offsets} {metadata}\n")
                failures = 0
            except Exception as exc:
                f.write(f"{sent} {time.monotonic_ns()} ERR {type(exc).__name__}\n")
                failures += 1
                if failures % 3 == 0:  # after a broker restart an admin client may never recover
                    admin = new_admin()
            time.sleep(max(0.0, 0.25 - (time.monotonic() - t0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
