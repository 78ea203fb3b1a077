"""A worker's engine is loaded and stepped in one thread (`EngineThread`), so that torch's
CPU kernels have one OpenMP team in the process: with a second one alive (the engine loaded
in the main thread, stepped in another), its workers sleep after every parallel region
and each region waits to wake them (measured 2026-12-06 on Zen 3)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_loop import EngineLoop
from pdserve.services.engine_thread import EngineThread


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_the_engine_loads_and_steps_in_one_thread(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=2,
                          kv_cache_tokens=1024)  # fmt: skip
    thread = EngineThread()
    engine, loaded_in = thread.submit(lambda: (LLMEngine(config), threading.get_ident())).result(
        timeout=120
    )
    stepped_in: set[int] = set()
    step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        stepped_in.add(threading.get_ident())
        return step()

    engine.step = recording_step  # type: ignore[method-assign]
    all_free = engine.kv_cache.num_free_blocks

    async def scenario() -> tuple[int, int]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), thread)
        loop.start()
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            await loop.add(list(range(100, 130)), params, "r")
            outs = [out async for out in loop.stream("r")]
            free = await loop.call(lambda: engine.kv_cache.num_free_blocks)
            return len(outs[-1].token_ids), free
        finally:
            loop.stop()

    tokens, free = asyncio.run(scenario())
    assert tokens == 6 and free == all_free
    assert stepped_in == {loaded_in}
    assert loaded_in != threading.get_ident()
    thread.join(timeout=5)
    assert not thread.is_alive(), "the engine thread outlived its loop"


def test_a_failed_load_reaches_the_caller_and_the_thread_runs_on():
    thread = EngineThread()

    def load() -> None:
        raise OSError("no such model")

    with pytest.raises(OSError, match="no such model"):
        thread.submit(load).result(timeout=5)
    assert thread.submit(lambda: 7).result(timeout=5) == 7
    thread.close()
    thread.join(timeout=5)
    assert not thread.is_alive()
