"""A pull whose sender says it sent every block, yet they never land (a prefill worker that
stopped mid-way): the decode side's receives are bounded by `landing_s` after that answer
(the decode worker derives it from --grpc-keepalive), so the pull fails UNAVAILABLE, its
posted receives are cancelled and the request's blocks go back; the lease on the prefill
side is untouched by the decode side and expires there."""

from __future__ import annotations

import asyncio

import pytest
from handoff_pair import make_pair, prefill
from opentelemetry.trace import Span

from pdserve.common.handoff.handle import TransferOrder
from pdserve.common.handoff.receiver import PullFailed
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPT = list(range(300, 348))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class SaysSentButSendsNothing:
    """`TransferKv` answered OK by a sender whose blocks never arrive."""

    def __init__(self) -> None:
        self.orders: list[TransferOrder] = []

    async def transfer(self, order: TransferOrder, span: Span) -> list[int]:
        self.orders.append(order)
        return []  # no checksums: the sender never sent

    async def release(self, lease_id: str) -> None:
        raise AssertionError("nothing is cached on decode here: no release")


def test_blocks_that_never_land_fail_the_pull_and_go_back(tiny_model_dir):
    pair = make_pair(tiny_model_dir)
    pair.receiver.landing_s = 0.2
    try:
        free = pair.decode.kv_cache.num_free_blocks
        first, handle = prefill(pair, PROMPT, GREEDY, "a")
        request, admitted = pair.receiver.arrive(PROMPT, first, GREEDY, "a", None)
        link = SaysSentButSendsNothing()
        with pytest.raises(PullFailed, match=r"had not landed 0\.2 s after") as failed:
            asyncio.run(pair.receiver.pull(request, handle, admitted.result(0), link))
        assert failed.value.reason == PullFailed.UNAVAILABLE
        assert [o.lease_id for o in link.orders] == [handle.lease_id]  # it did ask
        pair.receiver.abandon(request)
        pair.decode.step()
        assert not pair.decode.has_unfinished_requests()
        assert pair.decode.kv_cache.num_free_blocks == free
    finally:
        pair.close()
