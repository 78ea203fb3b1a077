"""The engine thread of one rank of an expert-parallel worker group.

Each rank is a worker of its own (its own gRPC server, KV cache, scheduler and requests:
data-parallel attention), but the MoE layers exchange token rows with every other rank, so
all ranks must run each model step together. `LockstepEngineLoop` is `EngineLoop` with that
rule: every iteration the ranks agree (one small all-reduce) whether any of them has work,
whether all of them are stopping, and whether any of them computed tokens last time; then
every rank runs one step — a rank with nothing to run joins with an empty batch — and,
between steps, the redundant experts may be re-placed. When no rank has work the ranks
poll each other, every 5 ms at first and every 50 ms once the group has been idle for a
second (`IDLE_POLL_S`): the first request after a quiet spell waits at most that long for
its group, and an idle group costs little CPU.

A collective that fails means a rank is gone: the group cannot step any more, so this
process reports which rank it is and exits; the coordinator routes around the group."""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from pdserve.services.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

IDLE_POLL_S = (0.005, 0.05)  # how often idle ranks check whether any has work: soon, later
QUIET_AFTER_S = 1.0  # idle this long: poll at the slower rate


class LockstepEngineLoop(EngineLoop):
    # Stopping waits for the other ranks to finish their streams too.
    stop_join_s = 60.0

    def _agree(self, busy: bool, stopping: bool, worked: bool) -> tuple[bool, bool, bool]:
        """(any rank busy, every rank stopping, any rank computed tokens last step)."""
        flags = torch.tensor([busy, not stopping, worked], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_busy, any_running, any_worked = (bool(v) for v in flags.tolist())
        return any_busy, not any_running, any_worked

    def _run(self) -> None:
        try:
            self._lockstep()
        except Exception as exc:  # a collective failed or timed out: a rank is gone
            text = str(exc).strip()
            reason = text.splitlines()[0] if text else type(exc).__name__
            logger.exception("expert-parallel step failed")
            print(
                f"pdserve: error: expert-parallel rank {dist.get_rank()}: the group failed "
                f"({reason}); exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def _lockstep(self) -> None:
        engine = self.engine
        runner = engine.runner
        worked = False  # this rank computed tokens in the last step
        stalled = False  # the last step was a busy one in which no rank computed anything
        last_busy = time.monotonic()
        while True:
            with self._wake:
                if (stalled and not self._woken) or (
                    not self._calls and not engine.has_unfinished_requests() and not self._stopped
                ):
                    # Idle, or requests that wait for blocks everywhere (leases,
                    # reservations): do not spin the group; a queued call wakes us.
                    quiet = time.monotonic() - last_busy > QUIET_AFTER_S
                    self._wake.wait(IDLE_POLL_S[quiet])
                stopping = self._stopped
                calls, self._calls = self._calls, []
                self._woken = False
            self._run_calls(calls)
            busy = engine.has_unfinished_requests()
            any_busy, all_stopping, any_worked = self._agree(busy, stopping, worked)
            if not any_busy:
                if all_stopping:
                    return
                worked = stalled = False
                continue
            last_busy = time.monotonic()
            before = runner.num_forwards
            # A failing step is not survivable here: the other ranks are mid-exchange.
            outputs = engine.step() if busy else []
            worked = runner.num_forwards != before
            if not worked:  # nothing ran here: join the others' exchanges
                runner.idle_step()
            runner.rebalance_experts_if_due()
            self.steps += 1
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            stalled = not any_worked and not worked
