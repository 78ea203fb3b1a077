"""Expert parallelism over real processes (torch.distributed, gloo on 127.0.0.1): each rank
holds only its share of the experts and its own tokens. The dispatch / compute / combine of
one MoE layer gives every rank what the single-process fused path gives on the full expert
set — with uneven and empty batches, at 2 and 4 ranks, also with redundant copies of a hot
expert after the weights moved between ranks to a new placement. `pdserve generate
--expert-parallel N` on tiny Mixtral and Qwen2-MoE models, each rank running its own
requests with its own KV cache (data-parallel attention), gives transformers' greedy ids
(ranks finishing at different steps keep joining with empty batches), also with redundant
experts re-placed every 2 steps mid-generation; bad values fail with a clear message before
any rank starts.

Each rank is this file run as a script (`python test_moe_expert_parallel.py CASE RANK ...`);
it writes its result with torch.save for the test to compare."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2
HOT = 3  # the hot expert of the redundant-experts case: one copy in the placement at load


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


def _layer_inputs(rank: int, tokens: int, hot: int | None = None):
    gen = torch.Generator().manual_seed(100)  # same experts on every rank
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gen.manual_seed(200 + rank)  # each rank its own tokens
    x = torch.randn(tokens, HIDDEN, generator=gen)
    scores = torch.randn(tokens, EXPERTS, generator=gen)
    scores[:, 0] += 2.0 * (rank % 2)  # odd ranks lean on expert 0: uneven splits
    if hot is not None:
        scores[:, hot] += 3.0  # in almost every token's top-k
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


@pytest.mark.parametrize(("world", "tokens", "redundant"), [(2, [9, 4], 2), (4, [5, 0, 17, 1], 4)])
def test_dispatch_with_redundant_experts_matches_single_process(tmp_path, world, tokens, redundant):
    """Each rank starts from the placement at load, moves its weights to a placement
    balanced for a skewed load (copies of the hot expert on several ranks), then runs the
    layer: the moved weights are the new slots' experts and the output is the fused one."""
    from pdserve.kernels.moe import fused_experts

    payload = {"tokens": tokens, "redundant": redundant}
    results = _run_ranks("replicas", world, tmp_path, payload)
    assert sum(r["moved"] for r in results) == world * results[0]["moved"] > 0
    for rank, res in enumerate(results):
        x, w13, w2, weights, ids = _layer_inputs(rank, tokens[rank], HOT)
        torch.testing.assert_close(res["local_w13"], w13[res["my_experts"]], rtol=0, atol=0)
        torch.testing.assert_close(res["local_w2"], w2[res["my_experts"]], rtol=0, atol=0)
        expected = fused_experts(x, w13, w2, weights, ids)
        torch.testing.assert_close(res["out"], expected, rtol=1e-5, atol=1e-5)
        assert res["rows_sent"] + res["rows_kept"] == tokens[rank] * TOP_K
    # The hot expert's rows were spread over its copies: more than one rank ran some.
    assert sum(r["ran_hot"] > 0 for r in results) > 1


def _generate(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`pdserve generate ARGS` (`pdserve -v generate` if ARGS starts with -v)."""
    env = dict(os.environ, PDSERVE_THREADS="1")
    verbose = ["-v"] if args[:1] == ["-v"] else []
    cmd = [sys.executable, "-m", "pdserve.services.cli", *verbose, "generate", "--no-progress",
           *args[len(verbose):]]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "ranks", "redundant"),
    # EP 4 runs with copies only: its idle ranks and uneven finish are the same either way.
    [("mixtral", 2, 0), ("mixtral", 2, 2), ("qwen2_moe", 4, 4)],
)
def test_generate_expert_parallel_matches_transformers(
    tmp_path, default_model_dir, family, ranks, redundant
):
    """With redundant experts the placement is recomputed every 2 forwards, and weights
    move between ranks mid-generation (rank 0's log says so): the tokens do not change."""
    from oracle import load_reference, reference_greedy
    from test_moe_greedy import build_tiny_moe

    folder = build_tiny_moe(tmp_path / family, family, default_model_dir)
    gen = torch.Generator().manual_seed(31)
    lens, new_tokens = (5, 40, 1, 17, 33), (12, 6, 12, 3, 9)  # ranks finish at different steps
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens]
    model = load_reference(folder)
    pairs = list(zip(prompts, new_tokens, strict=True))
    expected = [reference_greedy(model, p, m, None) for p, m in pairs]
    rows = [{"token_ids": p, "max_tokens": m, "ignore_eos": True} for p, m in pairs]
    rows.insert(2, {"prompt": "hi", "top_k": 0})  # a bad line keeps its place
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    flags = ["--model", str(folder), "--input", str(inp), "--output", str(out),
             "--dtype", "float32", "--kv-cache-tokens", "2048",
             "--expert-parallel", str(ranks)]  # fmt: skip
    if redundant:
        flags = ["-v", *flags, "--redundant-experts", str(redundant), "--eplb-interval", "2"]
    proc = _generate(flags)
    assert proc.returncode == 1, proc.stderr  # the one bad line
    if redundant:
        moves = [
            int(m) for m in re.findall(r"expert placement \d+ at forward \d+: (\d+)", proc.stderr)
        ]
        assert len(moves) >= 4 and sum(moves) > 0, proc.stderr[-3000:]
    assert "line 3: top_k" in proc.stderr and "Traceback" not in proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(len(rows)))
    assert "error" in results.pop(2)
    assert [r["token_ids"] for r in results] == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "ranks", "message"),
    [
        ("mixtral", 3, "must divide the model's 8 experts, got 3"),
        ("default", 2, "not a mixture-of-experts model"),
    ],
)
def test_expert_parallel_bad_values(tmp_path, default_model_dir, model, ranks, message):
    from test_moe_greedy import build_tiny_moe

    folder = default_model_dir
    if model == "mixtral":
        folder = build_tiny_moe(tmp_path / model, model, default_model_dir)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = str(tmp_path / "o.jsonl")
    proc = _generate(["--model", str(folder), "--input", str(inp), "--output", out,
                      "--expert-parallel", str(ranks)], timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_dead_rank_fails_the_group_fast(tmp_path, default_model_dir):
    """Rank 1 killed mid-run: rank 0 reports it and exits at once, no hang."""
    import signal
    import time

    from test_moe_greedy import build_tiny_moe

    folder = build_tiny_moe(tmp_path / "mixtral", "mixtral", default_model_dir)
    row = {"token_ids": list(range(3, 23)), "max_tokens": 480, "ignore_eos": True}
    inp = tmp_path / "in.jsonl"
    inp.write_text((json.dumps(row) + "\n") * 8)
    cmd = [sys.executable, "-m", "pdserve.services.cli", "generate", "--no-progress",
           "--model", str(folder), "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
           "--dtype", "float32", "--kv-cache-tokens", "8192", "--expert-parallel", "2"]  # fmt: skip
    env = dict(os.environ, PDSERVE_THREADS="1")
    rank0 = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (children := _children_of(rank0.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert children, "rank 1 never started"
        time.sleep(3)  # loading or stepping: either way the group must end at once
        assert rank0.poll() is None, rank0.communicate()[1]
        os.kill(children[0], signal.SIGKILL)
        # Far below the group's collective timeout (300 s): the death itself is noticed.
        _, err = rank0.communicate(timeout=60)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    assert rank0.returncode == 1
    assert "expert-parallel rank 1 exited" in err and "Traceback" not in err


def _rank_main(case: str, rank: int, world: int, port: int, tmp: Path) -> None:
    import torch.distributed as dist

    from pdserve.common.models.expert_parallel import (
        ExpertShard,
        TrafficCounter,
        ep_experts,
        move_experts,
    )

    payload = json.loads((tmp / "payload.json").read_text())
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)
    hot = HOT if case == "replicas" else None
    x, w13, w2, weights, ids = _layer_inputs(rank, payload["tokens"][rank], hot)
    shard = ExpertShard(rank, world, EXPERTS, redundant=payload.get("redundant", 0))
    traffic = TrafficCounter()
    local_w13, local_w2 = shard.local(w13), shard.local(w2)
    result: dict = {}
    slots = None
    if case == "replicas":
        from pdserve.common.models import eplb

        old = shard.initial_slots()
        loads = torch.full((1, EXPERTS), 10)
        loads[0, HOT] = 200  # copies on several ranks
        new = eplb.rebalance(loads, world, old.slot_expert.unsqueeze(0))[0]
        slots = eplb.SlotMap.of(new, EXPERTS)
        local_w13, local_w2, moved = move_experts(local_w13, local_w2, old, slots, shard)
        p = shard.slots_per_rank
        mine = new[rank * p : (rank + 1) * p]
        result.update(moved=moved, local_w13=local_w13, local_w2=local_w2, my_experts=mine)
    out = ep_experts(x, weights, ids, local_w13, local_w2, shard, traffic, slots)
    result.update(out=out, rows_sent=traffic.rows_sent, rows_kept=traffic.rows_kept)
    if slots is not None:
        # Rows this rank ran through a copy of the hot expert, from every rank's routing.
        counts = torch.zeros(world, dtype=torch.int64)
        routed = slots.route(ids, rank)
        for r in range(world):
            p = shard.slots_per_rank
            in_r = (routed >= r * p) & (routed < (r + 1) * p) & (ids == HOT)
            counts[r] = int(in_r.sum())
        dist.all_reduce(counts)
        result["ran_hot"] = int(counts[rank])
    torch.save(result, tmp / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
