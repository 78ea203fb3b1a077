"""The engine loop's cleanup of a request whose caller left: it is queued for the engine
thread before the caller's task yields, so a new request that reuses the id at once (a
client retrying after its deadline) is neither refused as "still in the engine" nor aborted
by the old request's cleanup, nor robbed of its output queue by the old handler's last
step. Found by the gRPC fuzzer (UNKNOWN statuses from a decode worker's local-prefill
path)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_loop import EngineLoop

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPT = list(range(100, 140))


def test_reused_id_right_after_a_cancelled_stream(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1, kv_cache_tokens=1024)
    )
    all_free = engine.kv_cache.num_free_blocks

    async def scenario() -> tuple[list[int], str | None, int]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            await loop.add(PROMPT, long, "same-id")
            got_first = asyncio.Event()

            async def consume() -> None:
                async for _ in loop.stream("same-id"):
                    got_first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_first.wait(), 60)
            task.cancel()
            await asyncio.sleep(0)  # the task runs its cancellation up to its first wait
            assert task.cancelling() or task.done()
            short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            await loop.add(PROMPT, short, "same-id")
            outs = [out async for out in loop.stream("same-id")]
            await asyncio.gather(task, return_exceptions=True)
            free = await loop.call(lambda: engine.kv_cache.num_free_blocks)
            return outs[-1].token_ids, outs[-1].finish_reason, free
        finally:
            loop.stop()

    tokens, reason, free = asyncio.run(scenario())
    assert reason == "length" and len(tokens) == 5
    assert free == all_free


def test_late_close_of_a_cancelled_stream_keeps_the_new_requests_queue(tiny_model_dir):
    """Found by the gRPC fuzzer (an UNKNOWN `KeyError` from a decode worker's local-prefill
    path): a cancelled handler's own last step, closing its stream, ran after a new request
    had reused the id, and took that request's output queue away."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1, kv_cache_tokens=1024)
    )
    all_free = engine.kv_cache.num_free_blocks

    async def scenario() -> tuple[list[int], int]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        started, reused, closed_late = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def handler(params: SamplingParams) -> None:  # as `DecodeServicer._local`
            await loop.add(PROMPT, params, "same-id")
            queue = loop.queue("same-id")
            finished = False
            try:
                async for out in loop.stream("same-id"):
                    started.set()
                    finished = out.finished
            finally:
                if not finished:
                    await reused.wait()
                    loop.close_stream("same-id", queue)
                    closed_late.set()

        try:
            task = asyncio.create_task(handler(SamplingParams(max_tokens=400, ignore_eos=True)))
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            await asyncio.sleep(0)  # its stream ends and starts the engine's cleanup
            await loop.add(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), "same-id")
            reused.set()
            await asyncio.wait_for(closed_late.wait(), 60)  # the old close came after
            outs = [out async for out in loop.stream("same-id")]
            await asyncio.gather(task, return_exceptions=True)
            free = await loop.call(lambda: engine.kv_cache.num_free_blocks)
            return outs[-1].token_ids, free
        finally:
            loop.stop()

    tokens, free = asyncio.run(scenario())
    assert len(tokens) == 5 and free == all_free
