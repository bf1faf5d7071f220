"""``keyedconsumer web``: an operations dashboard (extra ``keyedconsumer[web]``).

Consumer groups (members, offsets, lag, throughput, stalled partitions), the Redis sequencer's keys
(leases, parked keys, scheduled messages, instances) and dead letters, refreshed live; with
``--enable-actions`` and an access token, replay dead letters, un-park a key, cancel a scheduled
message. Modules: :mod:`.app` (routes), :mod:`.actions` (the actions), :mod:`.hosts` (the hosts
it answers), :mod:`.sampler` (what is shown, gathered in one thread), :mod:`.deadletters`
(dead-letter records as shown), :mod:`.auth` (token, sessions, CSRF), :mod:`.chart`; the actions
are written to the audit topic by :mod:`keyedconsumer.action_audit`.
"""

from __future__ import annotations

from .app import WebOptions, create_app

__all__ = ["WebOptions", "create_app"]
