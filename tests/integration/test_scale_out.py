"""Scale-out on real processes: 2 prefill + 2 decode workers behind one coordinator, the
default model. Prefix-aware routing keeps a conversation on the prefill worker that caches
it (read from the workers' own counters, against round-robin); `kill -9` of a decode or a
prefill worker with 16 streams in flight (half greedy, half seeded sampling; half of each
held to a JSON schema, whose grammar state the new leg rebuilds) loses no request and changes
no token and no character of text; a
worker started again later is picked up and used."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import signal
import socket
import threading
import time

import grpc
import pytest
from chat_prompts import QUESTIONS

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import running, start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1"]
MAX_TOKENS = 40
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 30}},
    "required": ["answer"],
    "additionalProperties": False,
}


def constrained(question: str) -> bool:
    """Streams numbered 2 and 3 mod 4 (one greedy, one seeded) are held to `ANSWER`."""
    number = question.rstrip(")").rsplit("(", 1)[-1]
    return number.isdigit() and int(number) % 4 in (2, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ports = {name: free_port() for name in ("p0", "p1", "d0", "d1")}
    services = {}
    try:
        for name, port in ports.items():
            role = "prefill" if name.startswith("p") else "decode"
            services[name] = start(role, *WORKER_ARGS, "--port", str(port))
        coordinator = start(
            "coordinator",
            f"--prefill-workers={services['p0'].grpc},{services['p1'].grpc}",
            f"--decode-workers={services['d0'].grpc},{services['d1'].grpc}",
        )
        services["coordinator"] = coordinator
        yield {"services": services, "ports": ports}
    finally:
        for service in services.values():
            service.stop()


def generate(address: str, question: str, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    """Tokens and text of one stream: greedy, or seeded sampling for questions ending in an
    odd number (a stream moved to another worker must go on with the same draws)."""
    number = question.rstrip(")").rsplit("(", 1)[-1]
    seeded = number.isdigit() and int(number) % 2 == 1
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        sampling = generate_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        if seeded:
            sampling.temperature, sampling.seed = 0.8, int(number)
        if constrained(question):
            sampling.structured_output.json_schema = json.dumps(ANSWER)
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            sampling=sampling,
        )
        responses = list(stub.Generate(request, timeout=300))
        return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


def streams_with_a_kill(cluster, victim: str, when, stop=None) -> tuple[list, list[str]]:
    """16 streams (half greedy, half seeded); `victim` gets SIGKILL (or `stop(victim)`)
    once `when(services)` holds."""
    services = cluster["services"]
    address = services["coordinator"].grpc
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(generate, address, q) for q in questions]
        deadline = time.monotonic() + 120
        while not when(services) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = when(services)  # the fault must hit the phase the test names
        (stop or (lambda service: service.kill()))(services[victim])
        assert held, f"{victim} was stopped before the streams reached the named phase"
        return [f.result() for f in futures], questions


def restart(cluster, name: str) -> None:
    role = "prefill" if name.startswith("p") else "decode"
    cluster["services"][name] = start(role, *WORKER_ARGS, "--port", str(cluster["ports"][name]))


@pytest.fixture(autouse=True)
def _workers_back_after_each_test(cluster):
    """A test that fails between killing a worker and restarting it must not leave the
    module's pool short for the tests after it: any worker that is not running is started
    again on its port."""
    yield
    for name in cluster["ports"]:
        if cluster["services"][name].proc.poll() is not None:
            restart(cluster, name)


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, tuple[list[int], str]]:
    address = cluster["services"]["coordinator"].grpc
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: generate(address, q), questions))
    return dict(zip(questions, outs, strict=True))


def test_decode_worker_killed_mid_stream(cluster, reference):
    def decoding_on_both(services) -> bool:
        return all(services[d].metric("pdserve_num_requests_running") >= 2 for d in ("d0", "d1"))

    outs, questions = streams_with_a_kill(cluster, "d0", decoding_on_both)
    for q, out in zip(questions, outs, strict=True):
        assert out == reference[q], q
        if constrained(q) and len(out[0]) < MAX_TOKENS:  # a complete structure
            assert set(json.loads(out[1])) == {"answer"}, out[1]
    coordinator = cluster["services"]["coordinator"]
    assert coordinator.metric("pdserve_request_failure_total") == 0
    restart(cluster, "d0")
    d0 = cluster["services"]["d0"]
    before = coordinator.metric("pdserve_router_decisions_total", target=d0.grpc)
    deadline = time.monotonic() + 30
    while coordinator.metric("pdserve_router_decisions_total", target=d0.grpc) == before:
        assert generate(coordinator.grpc, QUESTIONS[0], 4)
        assert time.monotonic() < deadline, "the restarted decode worker was never picked"
    deadline = time.monotonic() + 10  # its own record of a decoded request trails the stream
    while d0.metric("pdserve_request_decode_time_seconds_count") < 1:
        assert time.monotonic() < deadline, "the restarted decode worker decoded nothing"
        time.sleep(0.1)


def test_prefill_worker_killed_with_requests_in_flight(cluster, reference):
    def prefilling(services) -> bool:
        return services["p1"].metric("pdserve_num_requests_running") >= 1

    outs, questions = streams_with_a_kill(cluster, "p1", prefilling)
    for q, out in zip(questions, outs, strict=True):
        assert out == reference[q], q
    assert cluster["services"]["coordinator"].metric("pdserve_request_failure_total") == 0
    restart(cluster, "p1")


def conversation_hit_rate(cluster, policy: str, tag: str) -> tuple[float, list[list]]:
    """Multi-turn chats (a long per-conversation system prompt, 3 turns each; 3 clients
    running 2 chats each) through a coordinator with `policy`: the prefill workers'
    prefix-cache hit rate over them, and each chat's (prompt_tokens, cached_tokens) per turn.
    The shared prefix (~26 blocks) outweighs the load term of the queues 3 clients can build
    (8 per request), so on a slow machine prefix_aware still follows the cache rather than
    trading hits for balance, as it should under load."""
    services = cluster["services"]
    prefills = [services["p0"], services["p1"]]

    def counters() -> tuple[float, float]:
        q = sum(p.metric("pdserve_prefix_cache_queries_total") for p in prefills)
        h = sum(p.metric("pdserve_prefix_cache_hits_total") for p in prefills)
        return q, h

    turns: dict[int, list[tuple[int, int]]] = {}
    with running(
        "coordinator",
        f"--prefill-workers={prefills[0].grpc},{prefills[1].grpc}",
        f"--decode-workers={services['d0'].grpc},{services['d1'].grpc}",
        f"--policy={policy}",
    ) as coordinator:
        q0, h0 = counters()

        def chat(i: int) -> None:
            system = f"[{tag}-{i}] " + " ".join(f"Rule {k}: be brief and kind." for k in range(50))
            messages = [generate_pb2.ChatMessage(role="system", content=system)]
            turns[i] = []
            with grpc.insecure_channel(coordinator.grpc) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                for turn in range(3):
                    messages.append(generate_pb2.ChatMessage(role="user", content=f"Step {turn}?"))
                    responses = list(
                        stub.Generate(
                            generate_pb2.GenerateRequest(
                                messages=messages,
                                sampling=generate_pb2.SamplingParams(max_tokens=6, temperature=0),
                            ),
                            timeout=300,
                        )
                    )
                    usage = responses[-1].usage
                    turns[i].append((usage.prompt_tokens, usage.cached_tokens))
                    reply = "".join(r.text for r in responses)
                    # Sent at once: the prefill worker's report of this turn's blocks may
                    # not have reached the coordinator yet (the router's provisional holds).
                    messages.append(generate_pb2.ChatMessage(role="assistant", content=reply))

        def client(first: int) -> None:
            chat(first)
            chat(first + 3)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.5)  # the workers' counters trail their engine by a step
        q1, h1 = counters()
    return (h1 - h0) / (q1 - q0), [turns[i] for i in sorted(turns)]


def test_prefix_aware_routing_beats_round_robin(cluster):
    """prefix_aware sends every later turn of a chat to the prefill worker holding its
    history: each turn finds all full blocks of the turn before it (but at most the block
    the reply's first token may retokenize). Round-robin's hits depend on how the three
    clients' requests happen to interleave (anywhere from every later turn missing to
    nearly all hitting), so it is the floor prefix_aware must reach, not a fixed margin."""
    block = 16
    round_robin, _ = conversation_hit_rate(cluster, "round_robin", "rr")
    prefix_aware, chats = conversation_hit_rate(cluster, "prefix_aware", "pa")
    assert len(chats) == 6 and all(len(turns) == 3 for turns in chats)
    for turns in chats:
        assert turns[0][1] == 0, turns  # a fresh system prompt: nothing to hit
        for (previous_prompt, _), (_, cached) in itertools.pairwise(turns):
            assert cached >= (previous_prompt // block - 1) * block, (turns, prefix_aware)
    assert prefix_aware >= round_robin, (prefix_aware, round_robin)


def test_short_uncached_tail_is_prefilled_on_decode(cluster):
    """With --local-prefill-tokens, a conversation's next turn (its history cached on the
    decode worker that answered it) goes straight to that worker: no prefill call, no KV
    moved, and the same greedy tokens as the full path."""
    services = cluster["services"]
    system = "You answer in one short sentence. " * 12
    first = [
        generate_pb2.ChatMessage(role="system", content=system),
        generate_pb2.ChatMessage(role="user", content="Name a colour."),
    ]

    def ask(address: str, messages) -> list[int]:
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            request = generate_pb2.GenerateRequest(
                messages=messages,
                sampling=generate_pb2.SamplingParams(max_tokens=12, temperature=0),
            )
            return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]

    workers = [
        f"--prefill-workers={services['p0'].grpc},{services['p1'].grpc}",
        f"--decode-workers={services['d0'].grpc},{services['d1'].grpc}",
    ]
    with running("coordinator", *workers, "--local-prefill-tokens=64") as local:
        ask(local.grpc, first)  # turn 1: the full path; its decode worker caches the history
        second = [*first, generate_pb2.ChatMessage(role="assistant", content="Blue.")]
        second.append(generate_pb2.ChatMessage(role="user", content="And another?"))
        time.sleep(0.5)  # the decode worker's cache report reaches the coordinator
        before = local.metric("pdserve_router_local_prefills_total")
        got = ask(local.grpc, second)
        assert local.metric("pdserve_router_local_prefills_total") - before == 1
    assert got == ask(services["coordinator"].grpc, second)


def test_draining_worker_finishes_its_streams_and_takes_no_new_ones(cluster, reference):
    """SIGTERM to a decode worker with streams in flight: they finish (there or, when a
    stream is refused during the stop, on the other worker), new requests go elsewhere."""
    services = cluster["services"]
    d1 = services["d1"]

    def decoding_on_d1(services) -> bool:
        return d1.metric("pdserve_num_requests_running") >= 2

    address = services["coordinator"].grpc
    outs, questions = streams_with_a_kill(
        cluster, "d1", decoding_on_d1, stop=lambda service: service.proc.send_signal(signal.SIGTERM)
    )
    for q, out in zip(questions, outs, strict=True):
        assert out == reference[q], q
    assert d1.proc.wait(60) == 0  # it drained and left on its own
    coordinator = services["coordinator"]
    before = coordinator.metric("pdserve_router_decisions_total", pool="decode", target=d1.grpc)
    assert generate(address, QUESTIONS[1], 4)
    after = coordinator.metric("pdserve_router_decisions_total", pool="decode", target=d1.grpc)
    assert after == before
    assert coordinator.metric("pdserve_request_failure_total") == 0
