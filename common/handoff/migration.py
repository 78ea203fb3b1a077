"""Live migration, the source's side: a decode worker that drains hands its running streams'
KV to other decode workers instead of letting them be recomputed (crash failover still
recomputes: a lost worker's blocks are gone with it).

Between two engine steps (`pause`, the engine thread), each request that is decoding (every
token but the last sampled one has its KV computed) leaves the batch as a prefill worker's
request leaves it after its first token: PREFILLED, its blocks kept, and leased
(`KvSender.grant`) for exactly its computed tokens. Its handle goes to the coordinator with
the stream's last message; the coordinator calls another decode worker's `Decode` with it,
the computed tokens as the prompt (the request's prompt and every output token but the
last) and the last output token as the first token, resumed as a failover resumes
(`Resume`). That worker pulls the blocks as from a prefill worker (`KvReceiver.pull`, the
draining worker serving `TransferKv`), computes the last token's KV in its first step, and
samples what this worker would have sampled next. The lease ends as every lease ends:
pulled, released, or expired."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from pdserve.common.handoff.handle import KvHandle
from pdserve.common.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.common.handoff.sender import KvSender
    from pdserve.common.scheduler import Scheduler


def decoding(scheduler: Scheduler, keep: Container[str] = ()) -> list[Request]:
    """The running requests that can move now: each has output, and KV computed for every
    token but its last sampled one (a request still in its prompt, or preempted, moves
    once it decodes again). Those whose ids are in `keep` stay."""
    return [
        r
        for r in scheduler.running
        if r.output_token_ids
        and not r.prefill_only
        and r.num_computed_tokens == r.num_tokens - 1
        and r.num_computed_tokens > 0
        and r.request_id not in keep
    ]


def pause(
    scheduler: Scheduler, sender: KvSender, keep: Container[str] = ()
) -> list[tuple[Request, KvHandle]]:
    """Engine thread, between steps: take every request that can move (but those in
    `keep`) out of the batch, its blocks kept, and lease them; each with its handle."""
    moved = []
    for request in decoding(scheduler, keep):
        scheduler.finish(request, RequestStatus.PREFILLED)
        moved.append((request, sender.grant(request, request.num_computed_tokens)))
    return moved


def busy(scheduler: Scheduler) -> bool:
    """Whether a draining worker still has streams to move or leases being pulled."""
    return bool(scheduler.requests) or scheduler.remote.busy() or scheduler.leases.busy()
