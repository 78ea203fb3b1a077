"""Two engines joined by the real handoff, for unit tests: a prefill engine with its
`KvSender`, a decode engine with its `KvReceiver`, each on its own in-process transport, and
the `LocalLink` where processes call `TransferKv` over gRPC. `handoff` runs one request the
whole way, through both engines' own steps."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.handoff.handle import KvHandle
from pdserve.common.handoff.local_link import LocalLink
from pdserve.common.handoff.receiver import KvReceiver
from pdserve.common.handoff.sender import KvSender
from pdserve.common.handoff.transfer_metrics import NoMetrics
from pdserve.common.kv_transfer import create_transport
from pdserve.common.request import RequestStatus
from pdserve.common.sampling_params import SamplingParams


def engine(model_dir: Path, **config: object) -> LLMEngine:
    base = dict(model=str(model_dir), dtype="float32", threads=1, kv_cache_tokens=1024)
    return LLMEngine(EngineConfig(**{**base, **config}))  # type: ignore[arg-type]


def run(engine: LLMEngine) -> list:
    """Step until nothing is left; every output."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


async def _no_group(fn):  # tensor-parallel commands only: no group here
    raise AssertionError("no tensor-parallel group in this test")


class Pair(NamedTuple):
    prefill: LLMEngine
    decode: LLMEngine
    sender: KvSender
    receiver: KvReceiver

    def close(self) -> None:
        self.sender.transport.close()
        self.receiver.transport.close()


def make_pair(model_dir: Path, lease_s: float = 60.0, max_pending: int = 4) -> Pair:
    prefill, decode = engine(model_dir), engine(model_dir)
    transports = []
    for e in (prefill, decode):
        transport = create_transport("inproc")
        transport.register_pool(e.runner.kv_cache)
        transports.append(transport)
    sender = KvSender(prefill, transports[0], "prefill-unit", "127.0.0.1:1", lease_s, 5.0,
                      NoMetrics(), _no_group)  # fmt: skip
    receiver = KvReceiver(decode, transports[1], 5.0, NoMetrics(), _no_group,
                          max_pending=max_pending)  # fmt: skip
    return Pair(prefill, decode, sender, receiver)


def prefill(
    pair: Pair, prompt: list[int], params: SamplingParams, rid: str
) -> tuple[int, KvHandle]:
    """Prefill on the prefill engine: its first token, and the handle to its leased blocks
    (stepping until it is PREFILLED: a prefill engine holding leases always has work)."""
    request = pair.prefill.add_request(prompt, params, rid, prefill_only=True)
    outputs = []
    while request.status != RequestStatus.PREFILLED:
        outputs += pair.prefill.step()
    (first,) = outputs
    assert first.finished and first.finish_reason is None
    return first.new_token_ids[0], pair.sender.grant(request)


def handoff(
    pair: Pair, prompt: list[int], params: SamplingParams, rid: str
) -> tuple[list[int], int]:
    """Prefill on one engine, pull the blocks, decode on the other: (tokens, pulled)."""
    first, handle = prefill(pair, prompt, params, rid)
    pair.receiver.check(handle, len(prompt))
    request, admitted = pair.receiver.arrive(prompt, first, params, rid, None)
    num_cached = admitted.result(0)  # the blocks fit at once here
    pulled = asyncio.run(pair.receiver.pull(request, handle, num_cached, LocalLink(pair.sender)))
    pair.receiver.landed(request)
    outs = run(pair.decode)
    pair.prefill.step()  # the lease ended with the send: its blocks go back at this step
    assert not pair.prefill.has_unfinished_requests()
    return [first] + [t for o in outs for t in o.new_token_ids], pulled
