"""The coordinator's HTTP server keeps an idle keep-alive connection open longer than
clients keep theirs (httpx and Node expire theirs after 5 s), so a client reusing one is
never reset by the server closing it at the same moment (seen under overload as a
ReadError)."""

from __future__ import annotations

import asyncio
import socket

from fastapi import FastAPI

from pdserve.services.coordinator.http_api import HTTP_KEEP_ALIVE_S, HttpServer

CLIENT_IDLE_S = 6.0  # past uvicorn's own default of 5 s


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"pong" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    return data


async def _two_requests_one_connection(idle_s: float) -> tuple[bytes, bytes]:
    app = FastAPI()
    app.get("/ping")(lambda: "pong")
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            first = await asyncio.to_thread(_get, sock)
            await asyncio.sleep(idle_s)
            second = await asyncio.to_thread(_get, sock)
    finally:
        await server.drain(1)
    return first, second


def test_an_idle_connection_outlives_the_clients_expiry():
    assert HTTP_KEEP_ALIVE_S > CLIENT_IDLE_S
    first, second = asyncio.run(_two_requests_one_connection(CLIENT_IDLE_S))
    assert first.startswith(b"HTTP/1.1 200") and b"pong" in first
    assert second.startswith(b"HTTP/1.1 200") and b"pong" in second, second
