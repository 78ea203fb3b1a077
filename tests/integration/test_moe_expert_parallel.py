"""Expert parallelism over real processes (torch.distributed, gloo on 127.0.0.1): each rank
holds only its share of the experts and its own tokens. The dispatch / compute / combine of
one MoE layer gives every rank what the single-process fused path gives on the full expert
set — with uneven and empty batches, at 2 and 4 ranks — and a tiny Mixtral with its experts
split over 2 ranks, each rank prefilling its own prompt (data-parallel attention), gives the
unsplit model's logits.

Each rank is this file run as a script (`python test_moe_expert_parallel.py CASE RANK ...`);
it writes its result with torch.save for the test to compare."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(case: str, world: int, tmp: Path, payload: dict) -> list[dict]:
    """Start `world` rank processes, wait for all (bounded), return their saved results."""
    port = _free_port()
    (tmp / "payload.json").write_text(json.dumps(payload))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, str(HERE), case]
    procs = [
        subprocess.Popen(
            [*argv, str(rank), str(world), str(port), str(tmp)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    errors = []
    try:
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=180)
            if p.returncode != 0:
                errors.append(f"rank {rank} exited {p.returncode}: {err[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, "\n".join(errors)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _layer_inputs(rank: int, tokens: int):
    gen = torch.Generator().manual_seed(100)  # same experts on every rank
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gen.manual_seed(200 + rank)  # each rank its own tokens
    x = torch.randn(tokens, HIDDEN, generator=gen)
    scores = torch.randn(tokens, EXPERTS, generator=gen)
    scores[:, 0] += 2.0 * (rank % 2)  # odd ranks lean on expert 0: uneven splits
    weights, ids = torch.topk(torch.softmax(scores, dim=-1), TOP_K, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(("world", "tokens"), [(2, [9, 4]), (4, [5, 0, 17, 1])])
def test_dispatch_combine_matches_single_process(tmp_path, world, tokens):
    from pdserve.kernels.moe import fused_experts

    results = _run_ranks("layer", world, tmp_path, {"tokens": tokens})
    for rank, res in enumerate(results):
        x, w13, w2, weights, ids = _layer_inputs(rank, tokens[rank])
        expected = fused_experts(x, w13, w2, weights, ids)
        assert res["out"].shape == (tokens[rank], HIDDEN)
        torch.testing.assert_close(res["out"], expected, rtol=1e-5, atol=1e-5)
        assert res["rows_sent"] + res["rows_kept"] == tokens[rank] * TOP_K


@pytest.mark.slow
def test_tiny_mixtral_split_over_two_ranks(tmp_path, default_model_dir):
    from oracle import engine, engine_logits
    from test_moe_greedy import build_tiny_moe

    folder = build_tiny_moe(tmp_path / "mixtral", "mixtral", default_model_dir)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (37, 6)]
    results = _run_ranks("model", 2, tmp_path, {"model": str(folder), "prompts": prompts})
    whole = engine(folder, kv_cache_tokens=1024)
    for rank, res in enumerate(results):
        expected = engine_logits(whole, prompts[rank])
        torch.testing.assert_close(res["logits"], expected, rtol=1e-4, atol=1e-4)


def _rank_main(case: str, rank: int, world: int, port: int, tmp: Path) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parent.parent))  # tests/oracle.py
    from pdserve.common.models.expert_parallel import ExpertShard, TrafficCounter, ep_experts

    payload = json.loads((tmp / "payload.json").read_text())
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)
    if case == "layer":
        x, w13, w2, weights, ids = _layer_inputs(rank, payload["tokens"][rank])
        shard = ExpertShard(rank, world, EXPERTS)
        traffic = TrafficCounter()
        out = ep_experts(x, weights, ids, shard.local(w13), shard.local(w2), shard, traffic)
        result = {"out": out, "rows_sent": traffic.rows_sent, "rows_kept": traffic.rows_kept}
    else:
        from oracle import engine, engine_logits

        eng = engine(payload["model"], kv_cache_tokens=1024, threads=1)
        experts = eng.runner.hf_config.num_local_experts
        eng.runner.model.shard_experts(ExpertShard(rank, world, experts))
        result = {"logits": engine_logits(eng, payload["prompts"][rank])}
    torch.save(result, tmp / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
