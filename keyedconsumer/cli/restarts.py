"""When the supervisor of ``keyedconsumer run --processes N`` starts a child again, and when it gives up.

A pure policy (no clock, no process): the supervisor asks it after each child that ended without
being asked to (:mod:`.supervisor`). The rule, per slot (one of the N children):

- A child that ran less than ``stable_after_s`` before it ended counts as a **failed start**; one
  that ran longer does not, and resets its slot's count to 0.
- The next child of the slot starts after a back-off: ``backoff_s`` after a child that ran long,
  ``min(backoff_s * 2 ** (k - 1), backoff_max_s)`` after the k-th failed start in a row.
- After ``max_failed_starts`` failed starts in a row of one slot the supervisor gives up: it stops
  the other children gracefully and exits 1. A child that exits 2 (bad input: a setting, the
  handler) is never started again: the supervisor stops the others and exits 2 at once.

With the defaults a child that dies at once is started 4 more times over about 15 s (back-offs 1, 2,
4 and 8 s), then the supervisor gives up; a child that dies once a minute or less often is restarted
for ever (1 s later), as an orchestrator would restart one process.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestartPolicy", "BAD_INPUT_EXIT_CODE"]

#: The exit code of a child that could not start because of its input (``CliError`` exit 2: a bad
#: setting, a handler that does not import): starting it again cannot help.
BAD_INPUT_EXIT_CODE = 2


@dataclass(frozen=True)
class RestartPolicy:
    """Back-off and give-up rule of the supervisor (see the module documentation).

    Parameters
    ----------
    backoff_s:
        Seconds before the first restart of a slot (and after a child that ran long), > 0.
    backoff_max_s:
        The largest back-off, seconds, >= ``backoff_s``.
    stable_after_s:
        A child that ran at least this many seconds did not fail to start, > 0.
    max_failed_starts:
        Failed starts in a row of one slot after which the supervisor gives up, >= 1.

    Raises
    ------
    ValueError
        A bound out of its range.
    """

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0
    max_failed_starts: int = 5

    def __post_init__(self) -> None:
        if not (
            0 < self.backoff_s <= self.backoff_max_s
            and self.stable_after_s > 0
            and self.max_failed_starts >= 1
        ):
            raise ValueError(
                f"invalid {self!r}: need 0 < backoff_s <= backoff_max_s, stable_after_s > 0, max_failed_starts >= 1"
            )

    def failed_starts(self, previous: int, ran_s: float) -> int:
        """The slot's failed starts in a row after a child that ran ``ran_s`` seconds ended."""
        return previous + 1 if ran_s < self.stable_after_s else 0

    def gives_up(self, failed_starts: int) -> bool:
        """Whether the supervisor gives up after this many failed starts in a row of one slot."""
        return failed_starts >= self.max_failed_starts

    def backoff_for(self, failed_starts: int) -> float:
        """Seconds before the slot's next child starts, after ``failed_starts`` in a row (0: the
        last child ran long)."""
        if failed_starts <= 0:
            return self.backoff_s
        return float(min(self.backoff_s * 2 ** (failed_starts - 1), self.backoff_max_s))
