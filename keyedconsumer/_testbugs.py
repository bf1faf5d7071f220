"""Deliberate bugs for the fault-injection harness's negative controls (never for production).

``KEYEDCONSUMER_TEST_BUG`` names one bug, read once at import. A checker that cannot catch these
proves nothing (issue 6). Unset, every check below is a constant ``False``.

=================  ==================================================================================
name               bug
=================  ==================================================================================
``commit_on_poll`` store each message's offset as soon as it is polled, before its handler ran
``skip_fencing``   count a run's result even when its key's lease was lost or taken over meanwhile
=================  ==================================================================================
"""

from __future__ import annotations

import os

BUG = os.environ.get("KEYEDCONSUMER_TEST_BUG", "")
COMMIT_ON_POLL = BUG == "commit_on_poll"
SKIP_FENCING = BUG == "skip_fencing"
