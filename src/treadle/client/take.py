"""Taking a continuous job's complete groups (`POST /v1/jobs/{id}/take`): the call,
its answer, and one `take(n)`'s progress, shared by the sync and async clients (no
I/O here).

Exactly once: every take call carries an id of its own (`take_id`, new for each
call); the service hands a group out to one call only and answers the same id
with the same groups. So the client sends a call again after a lost answer (it
tries it like a GET: a dropped connection, a restarting service) and gets what it
missed, and no group is handed out twice, to this trainer or any other. The groups
are numbered in the order they were handed out (`Group.taken`, 1, 2, 3, ... per
job).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from treadle.client.errors import ServiceProtocolError
from treadle.client.groups import Group
from treadle.client.wire import Call, Delivered, _seg, decode_trajectory, json_of

POLL_S = 10.0  # the longest the service waits for groups in one call
_SLACK_S = 30.0  # the read timeout above a call's wait


@dataclass(frozen=True, slots=True)
class Taken:
    """One take call's answer."""

    groups: list[Group]  # in take order
    taken: int  # groups handed out so far (all takers)
    ended: bool  # the job has ended with nothing more to take


def take_call(job_id: str, n: int, wait_s: float) -> Call[Taken]:
    path = f"/v1/jobs/{_seg(job_id)}/take"

    def parse(r: httpx.Response) -> Taken:
        value = json_of(r, f"POST {path}")
        try:
            groups = [Group(g["group_id"], int(g["size"]), tuple(
                Delivered(int(m["seq"]), decode_trajectory(m["trajectory"], f"POST {path}"))
                for m in g["members"]), stale=bool(g["stale"]), taken=int(g["taken"]))
                for g in value["groups"]]
            return Taken(groups, int(value["taken"]), bool(value["ended"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ServiceProtocolError(f"POST {path}: unexpected answer ({e}): "
                                       f"{value!r:.200}") from None
    body = {"take_id": uuid.uuid4().hex, "n": n, "wait_s": wait_s}
    return Call("POST", path, parse, body,
                timeout_s=wait_s + _SLACK_S, idempotent=True)


class TakeProgress:
    """One `take(n)`: what to ask next and what came back. `timeout_s` None: wait
    until the n groups are there (or the job ends); else ask at least once and stop
    once it has passed."""

    def __init__(self, n: int, timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        self.n = n
        self.groups: list[Group] = []
        self._clock = clock
        self._deadline = None if timeout_s is None else clock() + timeout_s
        self._asked = False
        self._ended = False

    def next_call(self, job_id: str) -> Call[Taken] | None:
        """The next call to make; None once done."""
        if len(self.groups) >= self.n or self._ended:
            return None
        wait = POLL_S
        if self._deadline is not None:
            left = self._deadline - self._clock()
            if left <= 0 and self._asked:
                return None
            wait = max(0.0, min(POLL_S, left))
        self._asked = True
        return take_call(job_id, self.n - len(self.groups), wait)

    def got(self, taken: Taken) -> None:
        self.groups += taken.groups
        self._ended = taken.ended


__all__ = ["TakeProgress", "Taken", "take_call"]
