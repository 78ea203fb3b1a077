"""Tensor parallelism over real processes (torch.distributed, gloo on 127.0.0.1): each rank
holds only its heads, MLP rows and vocabulary range, and its KV cache only its KV heads.

- `pdserve generate --tensor-parallel 2` in float32 gives transformers' greedy ids on the
  chat prompts for SmolLM2 (3 KV heads over 2 ranks: an uneven split) and on tiny random
  Llama / Qwen2 (biases; 3 KV heads) / Mistral (1 KV head, replicated) models, and at 4
  ranks with replicated KV heads.
- Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) split
  their experts over the same ranks, and match transformers too.
- In bfloat16 a request's ids under tensor parallelism do not depend on its batch (all
  prompts at once, or one at a time), nor on whether the ranks' collectives go through
  shared memory or gloo.
- `pdserve colocated --tensor-parallel 2` serves the offline engine's ids at the same TP,
  with every KV block free afterwards; SIGKILL of rank 1 takes the group down with an
  error naming the rank (no hang).
- Sizes the model cannot be split into fail with a clear message before any rank starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from chat_prompts import QUESTIONS
from oracle import engine, load_reference, reference_greedy
from tiny_models import tiny_model

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import start

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


def generate(tmp: Path, lines: list[dict], *flags: str, env: dict | None = None) -> list[dict]:
    """`pdserve generate` over `lines`: its output rows, in order (bounded: 10 minutes)."""
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "generate", "--input", str(src),
         "--output", str(dst), "--no-progress", "--threads", "1", *flags],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in dst.read_text().splitlines()]


def chat_lines(max_tokens: int = NEW_TOKENS) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens} for q in QUESTIONS
    ]


def test_default_model_tp2_float32_matches_transformers(tmp_path, default_model_dir):
    rows = generate(tmp_path, chat_lines(), "--tensor-parallel", "2", "--dtype", "float32")
    eng = engine(default_model_dir, kv_cache_tokens=64)
    model = load_reference(default_model_dir)
    eos = eng.tokenizer.eos_token_id
    for question, row in zip(QUESTIONS, rows, strict=True):
        ids = eng.tokenize([{"role": "user", "content": question}])
        assert row["token_ids"] == reference_greedy(model, ids, NEW_TOKENS, eos), question


@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "world"),
    [("llama", 4, 2, 2), ("qwen2", 6, 3, 2), ("mistral", 4, 1, 2), ("llama", 8, 2, 4)],
)
def test_tiny_models_match_transformers(tmp_path, default_model_dir, arch, heads, kv_heads, world):
    folder = tiny_model(
        tmp_path, default_model_dir, arch,
        num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 1)]
    lines = [{"token_ids": p, "max_tokens": 16, "ignore_eos": True} for p in prompts]
    rows = generate(tmp_path, lines, "--model", str(folder), "--dtype", "float32",
                    "--tensor-parallel", str(world), "--max-num-batched-tokens", "32")  # fmt: skip
    model = load_reference(folder)
    for prompt, row in zip(prompts, rows, strict=True):
        assert row["token_ids"] == reference_greedy(model, prompt, 16, None)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_models_split_their_experts_too(tmp_path, default_model_dir, family):
    """Mixture-of-experts models at TP 2: attention by heads, the experts (and Qwen2-MoE's
    shared expert) split over the ranks; greedy ids equal transformers' in float32."""
    from test_moe_greedy import build_tiny_moe

    folder = build_tiny_moe(tmp_path / family, family, default_model_dir)
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 40, 1, 17)]
    lines = [{"token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in prompts]
    rows = generate(tmp_path, lines, "--model", str(folder), "--dtype", "float32",
                    "--tensor-parallel", "2", "--max-num-batched-tokens", "32")  # fmt: skip
    model = load_reference(folder)
    for prompt, row in zip(prompts, rows, strict=True):
        assert row["token_ids"] == reference_greedy(model, prompt, 12, None)


@pytest.fixture(scope="module")
def offline_tp2(tmp_path_factory) -> list[list[int]]:
    """The offline engine's bfloat16 ids at TP 2, all prompts in one batch."""
    rows = generate(tmp_path_factory.mktemp("tp2"), chat_lines(), "--tensor-parallel", "2")
    return [row["token_ids"] for row in rows]


def test_bf16_ids_do_not_depend_on_the_batch(tmp_path, offline_tp2):
    alone = generate(tmp_path, chat_lines()[::-1], "--tensor-parallel", "2", "--max-num-seqs", "1")
    assert [row["token_ids"] for row in alone[::-1]] == offline_tp2


def test_shared_memory_and_gloo_collectives_give_the_same_ids(tmp_path, offline_tp2):
    """The fixture ran with the shared-memory all-gather (kernels/shm_collective.py); over
    gloo the rank-order sums are the same, so are the ids."""
    from pdserve.kernels import shm_collective

    assert shm_collective.load() is not None  # else both runs took gloo
    gloo = generate(tmp_path, chat_lines(), "--tensor-parallel", "2", env={"PDSERVE_TP_SHM": "0"})
    assert [row["token_ids"] for row in gloo] == offline_tp2


def _stream(address: str, question: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            sampling=generate_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0),
        )
        return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]


def test_colocated_tp2_serves_the_offline_ids_and_dies_with_a_rank(offline_tp2, capfd):
    worker = start("colocated", "--tensor-parallel", "2", "--threads", "1",
                   "--kv-cache-tokens", "4096")  # fmt: skip
    try:
        free = worker.free_blocks()
        assert free == int(worker.metric("pdserve_kv_cache_num_blocks"))
        assert [_stream(worker.grpc, q) for q in QUESTIONS] == offline_tp2
        assert worker.free_blocks() == free
        followers = worker.info["rank_pids"]
        assert len(followers) == 1
        capfd.readouterr()
        os.kill(followers[0], signal.SIGKILL)
        assert worker.proc.wait(timeout=120) != 0  # rank 0 fails fast, never hangs
        assert "tensor-parallel rank 1 exited" in capfd.readouterr().err
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel", "4"],
         "--tensor-parallel: with fewer key/value heads (3) than ranks (4)"),
        (["--tensor-parallel", "2", "--expert-parallel", "2"],
         "tensor_parallel: not combined with expert_parallel yet"),
        (["--tensor-parallel", "0"], "tensor_parallel: must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_bad_tensor_parallel_flags_fail_before_any_rank_starts(tmp_path, flags, message):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "generate", "--input", str(src),
         "--output", str(tmp_path / "out.jsonl"), *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert message in run.stderr
    assert "Traceback" not in run.stderr
