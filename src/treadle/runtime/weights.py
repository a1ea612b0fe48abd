"""Weight updates' parts: what the runtime does with calls in flight, and with engines
after an update that ran past its timeout (`Runtime.update_weights` puts them
together), and the prefix-cache salt of a set of weights."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from treadle.engines.base import PauseMode
from treadle.runtime.contract import Runner
from treadle.runtime.pool import EnginePool, EngineSlot
from treadle.types import KVAcrossUpdates


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What one weight update did."""

    policy_version: int  # the version now served
    mode: PauseMode
    held_s: float  # clock seconds new engine calls were held (pause to resume)
    kept: int  # calls in flight frozen in their engines and continued
    aborted: int  # calls in flight aborted (their turns resume with what they returned)


def weights_salt(policy_version: int, trainer_run: str | None) -> str:
    """The cache salt of one run's weights of one version (vLLM refuses '/' and '@'
    in a salt, which a run's name may hold: it is hashed). `Runtime.cache_salt` adds
    which weights load of that runtime it is."""
    if trainer_run is None:
        return f"policy-{policy_version}"
    run = hashlib.blake2b(trainer_run.encode(), digest_size=8).hexdigest()
    return f"policy-{policy_version}-{run}"


def keeps(slot: EngineSlot) -> bool:
    """Whether the engine freezes its calls through a weight load (and says which
    weights sampled each token)."""
    return "keep" in slot.engine.capabilities.pause_modes



@dataclass(frozen=True, slots=True)
class Quiesced:
    """The calls in flight once `quiesce` returns."""

    kept: int  # calls frozen in engines that keep them
    aborted: int  # calls aborted (their turns resume with what they returned)
    # Engines holding a kept call whose trajectory recomputes its KV under new
    # weights (`KVAcrossUpdates.RECOMPUTE`): their frozen calls must not go on over
    # KV of the old weights.
    recompute_on: frozenset[str]


async def quiesce(runners: Iterable[Runner], pool: EnginePool, mode: PauseMode) -> Quiesced:
    """With new calls held: abort or wait for the calls in flight as `mode` says;
    return once only calls to keep are in flight."""
    keep = {s.engine_id for s in pool.slots() if mode == "keep" and keeps(s)}
    kept = aborted = 0
    recompute: set[str] = set()
    for runner in list(runners):
        engine_id = runner.calling_on
        if engine_id is None:
            continue
        if engine_id in keep:
            kept += 1
            if runner.kv is KVAcrossUpdates.RECOMPUTE:
                recompute.add(engine_id)
        elif mode != "drain":
            runner.abort_for_pause()
            aborted += 1
    await pool.quiet(keep)
    return Quiesced(kept, aborted, frozenset(recompute))


async def roll_back(pool: EnginePool, loads: dict[asyncio.Task[None], EngineSlot],
                    previous: tuple[str, int] | None,
                    bound: AbstractAsyncContextManager[object]) -> list[str]:
    """After a timed-out update (`loads`: its engines' loads): every engine back on
    the `previous` weights, reloaded within `bound`, or failed. The labels of the
    engines that were still loading."""
    late = [slot for task, slot in loads.items() if not task.done()]
    for task in loads:
        task.cancel()  # not awaited: a hung engine may not answer; its client closes
    finished = [(task, slot) for task, slot in loads.items()
                if task.done() and not task.cancelled()]
    loaded = [slot for task, slot in finished if task.exception() is None]
    broken = [slot for task, slot in finished if task.exception() is not None]
    back: list[EngineSlot] = []
    if previous is not None and loaded:
        reloads = {asyncio.ensure_future(s.engine.update_weights(*previous)): s
                   for s in loaded}
        with contextlib.suppress(TimeoutError):
            async with bound:
                await asyncio.wait(reloads)
        for task, slot in reloads.items():
            if task.done() and not task.cancelled() and task.exception() is None:
                back.append(slot)
            else:
                task.cancel()
    for slot in [*late, *loaded, *broken]:  # a failed load leaves weights unknown
        if slot not in back:
            pool.fail(slot, "weight update timed out: its weights are not the ones the "
                            "other engines serve")
    return [slot.label for slot in late]
