"""A Decode whose caller leaves while its arrival is still queued for the engine thread (the
one call that makes the prefilled request and reserves its blocks, which waits for a step
boundary): once that call has run, what it made goes back (the servicer has
`KvReceiver.abandon` it, and the engine's next step gives its blocks back). The real twin
of the caller leaving after arrival is `test_cancel_mid_decode_frees_blocks_on_both_workers`
(tests/integration)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.kv_transfer import create_transport
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.engine_loop import EngineLoop
from pdserve.services.metrics import WorkerMetrics
from pdserve.services.worker import Worker
from pdserve.v1 import decode_pb2, generate_pb2, kv_pb2

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PREFILL = "127.0.0.1:1"  # named, never dialled: the caller leaves before any pull
PROMPT = list(range(100, 140))  # 3 blocks of 16


class _Context:
    """What the servicer asks of a grpc.aio context on this path."""

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()) -> None:
        raise AssertionError(f"aborted: {code} {details}")


def test_caller_gone_while_arrival_queued_gives_back_its_blocks(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1, kv_cache_tokens=1024)
    )
    all_free = engine.kv_cache.num_free_blocks
    transport = create_transport("inproc")
    transport.register_pool(engine.runner.kv_cache)

    async def scenario() -> dict[str, object]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        worker = Worker(
            role="decode", worker_id="decode-unit", address="127.0.0.1:2", loop=loop,
            transport=transport, metrics=WorkerMetrics(engine, "decode", "decode-unit", "tiny"),
            transfer_timeout_s=5,
        )  # fmt: skip
        servicer = DecodeServicer(worker, max_pending=4, prefill_workers=[PREFILL])
        free_after_arrival: list[int] = []
        arrive = servicer.receiver.arrive

        def recorded_arrive(*args):  # engine thread: what the arrival left held
            made = arrive(*args)
            free_after_arrival.append(engine.kv_cache.num_free_blocks)
            return made

        servicer.receiver.arrive = recorded_arrive
        loop.start()
        gate, holding = threading.Event(), threading.Event()
        loop.submit(lambda: (holding.set(), gate.wait(30)))  # a step that will not end yet
        try:
            assert await asyncio.to_thread(holding.wait, 30)
            handle = kv_pb2.KvHandle(
                worker_id="p", grpc_address=PREFILL, transport=transport.kind,
                transport_address=b"x", lease_id="l", block_ids=[1, 2, 3],
                num_tokens=len(PROMPT), block_size=engine.config.block_size,
                layout_fingerprint=engine.runner.layout_fingerprint, lease_ttl_ms=60_000,
            )  # fmt: skip
            request = decode_pb2.DecodeRequest(
                request_id="gone", prompt_token_ids=PROMPT, first_token_id=5, kv_handle=handle,
                sampling=generate_pb2.SamplingParams(max_tokens=8, temperature=0),
            )  # fmt: skip

            async def consume() -> None:
                async for _ in servicer.Decode(request, _Context()):
                    pass

            task = asyncio.create_task(consume())
            for _ in range(1000):  # until the handler has opened its stream: the arrival is
                await asyncio.sleep(0.001)  # queued in the same breath, behind the gate
                try:
                    loop.queue("gone")
                    break
                except KeyError:
                    continue
            else:
                raise AssertionError("the handler never queued its arrival")
            queued_unrun = not free_after_arrival
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            gate.set()
            await loop.call(lambda: None)  # after the arrival (and its abandon, queued)
            while await loop.call(engine.has_unfinished_requests):  # until a step settled it
                await asyncio.sleep(0.01)
            return {
                "queued_unrun": queued_unrun,
                "cancelled": task.cancelled(),
                "free_after_arrival": free_after_arrival,
                "free": await loop.call(lambda: engine.kv_cache.num_free_blocks),
                "pending": len(engine.scheduler.remote.pending),
                "in_engine": "gone" in engine.scheduler.requests,
            }
        finally:
            gate.set()
            loop.stop()
            transport.close()

    got = asyncio.run(scenario())
    assert got["queued_unrun"] and got["cancelled"]  # the caller left before the arrival ran
    assert got["free_after_arrival"] == [all_free - 3]  # which then made and reserved 3 blocks
    assert got["free"] == all_free  # and they came back
    assert got["pending"] == 0 and not got["in_engine"]
