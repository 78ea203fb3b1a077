"""An emulated Kubernetes API server for discovery tests: kmock's KubernetesEmulator on
127.0.0.1 with `discovery.k8s.io/v1` EndpointSlices declared, so the official client can
create, patch, delete, list and watch them. Prints its port on the first line of stdout and
serves until killed. kmock ignores label selectors and resourceVersion (discovery applies
the selector itself)."""

from __future__ import annotations

import asyncio

from kmock import KubernetesEmulator, ResourceInfo, Server


async def serve() -> None:
    async with KubernetesEmulator() as api, Server(api, host="127.0.0.1", port=0) as server:
        api.resources["discovery.k8s.io/v1/endpointslices"] = ResourceInfo(
            kind="EndpointSlice",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
        )
        print(server.port, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve())
