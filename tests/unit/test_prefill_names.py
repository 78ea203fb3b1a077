"""The coordinator names each prefill worker to the decode workers as it dialled it and as
the worker advertises itself (its status reports' `address`, which its KV handles carry),
and a prefill worker becomes routable only after the decode workers were told: so a handle
is never refused for its spelling (`localhost:PORT` dialled, `127.0.0.1:PORT` advertised).
In-process gRPC servers stand in for the workers; the real twin is
tests/integration/test_disaggregated.py's mismatched-spelling test."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.coordinator.pool import WorkerPool
from pdserve.services.coordinator.prefill_names import PrefillNames
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

ADVERTISED = "10.0.0.7:50061"


class Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Status(worker_pb2_grpc.WorkerStatusServiceServicer):
    def __init__(self, role: str, address: str) -> None:
        self.role, self.address = role, address

    async def Watch(self, request, context):
        while True:
            yield worker_pb2.WatchResponse(
                worker_id=self.role, role=self.role, block_size=16, total_blocks=8,
                free_blocks=8, address=self.address, reset=True,
            )  # fmt: skip
            await asyncio.sleep(0.05)


class Decode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.lists: list[tuple[int, list[str]]] = []

    async def SetPrefillWorkers(self, request, context):
        self.lists.append((request.generation, list(request.addresses)))
        return decode_pb2.SetPrefillWorkersResponse()


async def serve(*servicers) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    for add, servicer in servicers:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"localhost:{port}"  # dialled as a name, as the case


def test_a_prefill_worker_is_routable_only_once_decode_knows_its_advertised_address() -> None:
    async def main() -> None:
        decode = Decode()
        prefill_server, prefill_address = await serve(
            (worker_pb2_grpc.add_WorkerStatusServiceServicer_to_server,
             Status("prefill", ADVERTISED)),
        )  # fmt: skip
        decode_server, decode_address = await serve(
            (worker_pb2_grpc.add_WorkerStatusServiceServicer_to_server,
             Status("decode", "10.0.0.8:50071")),
            (decode_pb2_grpc.add_DecodeServiceServicer_to_server, decode),
        )  # fmt: skip
        prefill = WorkerPool(
            "prefill", [prefill_address], prefill_pb2_grpc.PrefillServiceStub,
            wait_for_worker_s=10,
        )  # fmt: skip
        decode_pool = WorkerPool(
            "decode", [decode_address], decode_pb2_grpc.DecodeServiceStub, wait_for_worker_s=10
        )
        names = PrefillNames(prefill, decode_pool)
        try:
            decode_pool.start()
            await decode_pool.pick()  # the decode worker is in routing
            prefill.start()
            worker = await prefill.pick()
            # Routable: the decode worker already holds a list naming both spellings.
            assert worker.advertised == ADVERTISED
            generation, newest = max(decode.lists)
            assert newest == sorted([prefill_address, ADVERTISED])
            assert decode.lists[-1][0] == generation  # generations grow with each list
            assert names.addresses() == sorted([prefill_address, ADVERTISED])
        finally:
            await prefill.close()
            await decode_pool.close()
            await prefill_server.stop(0)
            await decode_server.stop(0)

    asyncio.run(main())


def test_an_advertised_address_that_could_not_be_named_is_ignored() -> None:
    async def main() -> None:
        server, address = await serve(
            (worker_pb2_grpc.add_WorkerStatusServiceServicer_to_server,
             Status("prefill", "x" * 300)),
        )  # fmt: skip
        pool = WorkerPool("prefill", [address], prefill_pb2_grpc.PrefillServiceStub)
        told = []

        async def on_advertised(worker) -> None:
            told.append(worker.advertised)

        pool.on_advertised = on_advertised
        try:
            pool.start()
            worker = await pool.pick()  # routable all the same, under its dialled name
            assert worker.advertised == "" and not told
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(main())
