"""Gemma 3 and Qwen3 served split, on real processes: a tiny random-weight checkpoint
(`tiny_models.py`: Gemma's sliding-window layers with a window shorter than the prompts)
behind a coordinator, one prefill and one decode worker, the KV handed over UCX. Greedy ids
of token prompts and of a chat (through the folder's chat template) equal the offline
engine's, and both workers get every KV block back."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import torch
from tiny_models import tiny_model

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import RunningService, start

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
PROMPT_LENS = (5, 17, 40, 33, 9, 70)
WORKER_ARGS = ["--kv-cache-tokens", "2048", "--threads", "1", "--max-num-batched-tokens", "32"]
CHAT = [{"role": "user", "content": "Name three rivers of Europe."}]


def _request(prompt: list[int] | list[dict]) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    if prompt and isinstance(prompt[0], dict):
        messages = [generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
        return generate_pb2.GenerateRequest(messages=messages, sampling=sampling)
    return generate_pb2.GenerateRequest(token_ids=prompt, sampling=sampling)


def _generate(address: str, prompt: list[int] | list[dict]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        ids: list[int] = []
        for response in stub.Generate(_request(prompt), timeout=120):
            ids += response.token_ids
        return ids


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_one_prefill_one_decode_serve_the_offline_ids(tmp_path, default_model_dir, arch):
    folder = tiny_model(tmp_path, default_model_dir, arch)
    gen = torch.Generator().manual_seed(5)
    prompts: list = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts.append(CHAT)
    offline_engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_tokens=2048))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    offline = [out.token_ids for out in offline_engine.generate(prompts, params)]

    started: list[RunningService] = []
    try:
        for role in ("prefill", "decode"):
            started.append(start(role, "--model", str(folder), *WORKER_ARGS))
        prefill, decode = started
        workers = [f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}"]
        started.append(start("coordinator", "--model", str(folder), *workers))
        coordinator = started[-1]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(lambda p: _generate(coordinator.grpc, p), prompts))
        assert served == offline
        for worker in (prefill, decode):
            free, total = worker.blocks_once_idle()
            assert free == total, worker.role
    finally:
        for service in reversed(started):
            service.stop()
