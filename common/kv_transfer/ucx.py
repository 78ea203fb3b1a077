"""The UCX KV transport: how a request's KV cache moves from the prefill worker to the decode
worker when they are separate processes.

Decode allocates blocks for the request and posts one tag receive per block straight into its
cache pool (`post_receive`); it then asks prefill over gRPC to send, and prefill's `send` posts
one tag send per block from its own pool to decode's worker address. Block i travels under
tag `tag | i`; no staging copy is made on either side (`ucxx._lib.arr.Array` views of every
block are built once in `register_pool`).

Between processes on one host a block is copied once: UCX's rendezvous protocol has the
receiver read it straight out of the sender's pool over `cma` (`process_vm_readv`), where the
kernel lets one process read another's memory (`single_copy_refusal` says why not; the
transport then logs the reason and UCX copies each block twice, through a shared-memory
segment). Across hosts UCX uses TCP (or whatever `UCX_TLS` adds).

Threading: one daemon thread per transport owns the UCX context, worker and endpoints and makes
every UCX call. The public methods only queue a command and wake it through an eventfd. While
requests keep completing, the thread polls the worker (yielding the CPU between polls);
otherwise it sleeps on the worker's armed epoll fd, the eventfd and the nearest deadline, so an
idle transport costs no CPU. Futures complete on that thread: their done-callbacks must be
short and must not wait on the transport.

What cancel(tag), a timeout, close() or a failed block guarantee:

- Receive: a transfer's block receives are posted through an endpoint of their own (to this
  worker itself, never sent on), which ucxx tracks them by; aborting closes that endpoint, which
  cancels in UCX (`ucp_request_cancel`) every receive that no incoming message has matched yet:
  those can never write. UCX cannot cancel a receive whose message has already matched (its
  data is arriving); the transport keeps progressing those and fails the future only when
  every block request has finished, so once the future has failed nothing writes into its
  blocks. Exception: matched blocks still unfinished `ABORT_GRACE_S` after the abort (a sender
  that stalled mid-block) are given up on; the future fails then, and such a block may still be
  written if its data ever arrives.
- Send: UCX cannot cancel a send request, so an aborted send whose blocks are not all sent
  takes the endpoint to its peer out of the cache (the next send reconnects, ~10 ms) and
  force-closes it as soon as the other sends on it have finished, or at the latest
  `ABORT_GRACE_S` later; the sends still unfinished then fail too, their error naming the
  aborted tag. The aborted send's future fails after that close: from then on this process no
  longer touches its blocks. A send that fails because the peer died closes the endpoint at
  once. On one host the peer may still be reading blocks of a send that failed (the single
  copy is the receiver's read, which the sender cannot revoke; the sender's memory is never
  written): a receive's blocks are good only when the send that filled them succeeded, which
  the decode side learns from `TransferKv`'s answer.
- Either way, free the blocks only once the future has failed, not right after `cancel`. A
  timeout counts from the call; the future fails at the deadline plus the waits above (none in
  the usual case). Fewer blocks sent than the receive expects leave the receive to time out,
  more leave the send to time out: a tag message carries no count.

UCX settings the environment leaves unset get `ucx_env_defaults()`: `UCX_TLS=posix,self,tcp`
plus `cma` where allowed (and CUDA transports when CUDA is available), and what shared memory
and `cma` need to be chosen. On GPU pools, the stream that wrote the blocks must be
synchronised before `send`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import select
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.common.kv_transfer.base import KvTransferError, KvTransport, TransferResult

log = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0  # how long an aborted transfer waits for blocks UCX could not cancel
SPIN_S = 0.002  # keep polling this long after the last completion before sleeping
IDLE_WAKE_S = 1.0  # longest sleep without any deadline
PROGRESS_STEPS = 32  # ucp_worker_progress calls between looks at commands and deadlines
# UCX aborts the process on a malformed worker address, so ours travel in a checked envelope.
_ADDRESS_MAGIC = b"pdserve-ucx1:"
_DIGEST_BYTES = 8


def _seal(ucx_address: bytes) -> bytes:
    digest = hashlib.blake2b(ucx_address, digest_size=_DIGEST_BYTES).digest()
    return _ADDRESS_MAGIC + digest + ucx_address


def _unseal(address: bytes) -> bytes:
    head = len(_ADDRESS_MAGIC) + _DIGEST_BYTES
    body = address[head:]
    if not address.startswith(_ADDRESS_MAGIC) or not body or _seal(body) != address:
        raise KvTransferError(
            f"peer address {address[:24]!r} ({len(address)} bytes) is not a UCX transport's"
        )
    return body


YAMA_PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
PROC_STATUS = Path("/proc/self/status")
_CAP_SYS_PTRACE = 19  # its bit in PROC_STATUS's CapEff


def single_copy_refusal() -> str | None:
    """Why UCX's `cma` transport (a receiver's `process_vm_readv` of its sender's blocks)
    cannot work between this worker and its peers on the host, or None when it can. Yama's
    `ptrace_scope` decides, as UCX's own check does (UCX opens scope 1 to its peers itself,
    with `PR_SET_PTRACER_ANY`); a seccomp filter that refuses the call is caught by UCX at
    start-up (`UcxTransport.same_host` then says so)."""
    try:
        scope = YAMA_PTRACE_SCOPE.read_text().strip()
    except OSError:
        return None  # no Yama: processes of one user may read each other's memory
    if scope in ("0", "1") or (scope == "2" and _has_cap_sys_ptrace()):
        return None
    if scope == "2":
        return "Yama ptrace_scope is 2 and the process lacks CAP_SYS_PTRACE"
    return f"Yama ptrace_scope is {scope}: no process may read another's memory"


def _has_cap_sys_ptrace() -> bool:
    try:
        lines = PROC_STATUS.read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        return bool(int(fields["CapEff"], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, KeyError, ValueError):
        return False


def ucx_env_defaults() -> dict[str, str]:
    """The UCX settings the transport applies unless the environment sets them."""
    single_copy = single_copy_refusal() is None
    tls = "posix,self,tcp" + (",cma" if single_copy else "")
    tls += ",cuda_copy,cuda_ipc" if torch.cuda.is_available() else ""
    defaults = {
        "UCX_TLS": tls,
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        # Endpoints handle peer failure; UCX only picks shared memory for such endpoints with
        # this on, else everything goes over tcp on loopback (~5x slower here).
        "UCX_MM_ERROR_HANDLING": "y",
        # Finds dead peers, and senders whose endpoint was closed mid-send, in about a second
        # rather than 20 s; destroying a worker waits on such half-received messages.
        "UCX_KEEPALIVE_INTERVAL": "1s",
    }
    if single_copy:
        # With peer failure handling on, UCX runs rendezvous over `cma` only if cma can revoke
        # a peer's access to a failed transfer's buffer, which it cannot (without this, UCX
        # copies through shared memory instead). The receiver reads the sender's blocks, so
        # what is not revoked is a read of a failed send's blocks: the module docstring says
        # why that is harmless here.
        defaults["UCX_CMA_MEMORY_INVALIDATE"] = "y"
    return defaults


def _same_host(context: Any) -> tuple[str, int]:
    """How UCX moves blocks between this process and a peer on the same host, and why; and
    the level to log that at (a warning when the host, not the settings, refuses cma)."""
    if "cma/" in context.info:  # a resource UCX found usable
        return "cma: one copy, the receiver reads the sender's blocks", logging.INFO
    tls = context.config.get("TLS", "")
    reason, level = single_copy_refusal(), logging.WARNING
    if reason is None and "cma" not in tls and tls not in ("all", "sm", "shm"):
        reason, level = f"UCX_TLS={tls} leaves out cma", logging.INFO
    return f"posix shared memory: two copies ({reason or 'UCX found cma unusable'})", level


@dataclass(eq=False)
class _Transfer:
    tag: int
    peer: bytes | None  # None for a receive
    views: list[tuple[int, Any]]  # (index under the tag, buffer view)
    nbytes: int
    timeout: float
    keep: Any = None  # buffers that are not the pool's: alive until the transfer ends
    future: Future[TransferResult] = field(default_factory=Future)
    start: float = field(default_factory=time.monotonic)
    requests: list[Any] = field(default_factory=list)
    endpoint: Any = None  # a send's, to its peer
    group: Any = None  # a receive's: the endpoint its requests are posted through
    done: int = 0  # requests[:done] have completed
    failure: str | None = None  # why it was aborted; set once
    give_up_at: float = math.inf

    @property
    def deadline(self) -> float:
        return self.start + self.timeout

    @property
    def name(self) -> str:
        return f"{'send' if self.peer is not None else 'receive'} {self.tag:#x}"


class UcxTransport(KvTransport):
    kind = "ucx"

    def __init__(self) -> None:
        super().__init__()
        for name, value in ucx_env_defaults().items():
            os.environ.setdefault(name, value)
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array

        self._ucx = ucx
        self._array = Array
        self._lock = threading.Lock()  # guards _closed, _commands and the eventfd's life
        self._closed = False
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._views: list[Any] = []
        self._block_nbytes = 0
        self._pool: torch.Tensor | None = None  # keeps the blocks' memory alive
        # Owned by the thread.
        self._transfers: dict[tuple[int, bytes | None], _Transfer] = {}
        self._endpoints: dict[bytes, Any] = {}
        self._idle_groups: list[Any] = []  # receive groups with nothing posted on them
        # Endpoints out of the cache, to be closed once their other sends are done:
        # (endpoint, peer, close at the latest, why).
        self._retiring: list[tuple[Any, bytes, float, str]] = []
        self._address = b""
        self._worker: Any = None
        #: how blocks move between processes on this host, and why (see `_same_host`)
        self.same_host = ""
        self._same_host_level = logging.INFO
        self._startup_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="pdserve-kv-ucx", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            raise KvTransferError(f"UCX start-up failed: {self._startup_error}")
        message = f"KV blocks between processes on this host: {self.same_host}"
        log.log(self._same_host_level, message)

    @property
    def address(self) -> bytes:
        return self._address

    def register_pool(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous() or kv_cache.dim() < 1:
            raise ValueError("kv_cache: must be a contiguous [num_blocks, ...] tensor")
        rows = kv_cache.detach().view(torch.uint8).reshape(kv_cache.shape[0], -1)
        if rows.device.type == "cpu":
            rows = rows.numpy()  # buffer protocol; CUDA tensors carry __cuda_array_interface__
        self._block_nbytes = rows.shape[1]
        self._pool = kv_cache
        self._views = [self._array(rows[i]) for i in range(kv_cache.shape[0])]

    def post_receive(
        self, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        self.check_blocks(block_ids, self._num_blocks())
        return self._submit(_Transfer(tag, None, *self._block_views(block_ids), timeout))

    def send(
        self, peer: bytes, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        try:
            self.check_blocks(block_ids, self._num_blocks())
            _unseal(peer)
        except KvTransferError as e:
            future: Future[TransferResult] = Future()
            future.set_exception(e)
            return future
        return self._submit(_Transfer(tag, bytes(peer), *self._block_views(block_ids), timeout))

    def post_receive_buffers(
        self, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        views, nbytes = self._buffer_views(buffers)
        return self._submit(_Transfer(tag, None, views, nbytes, timeout, keep=buffers))

    def send_buffers(
        self, peer: bytes, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        try:
            _unseal(peer)
        except KvTransferError as e:
            future: Future[TransferResult] = Future()
            future.set_exception(e)
            return future
        views, nbytes = self._buffer_views(buffers)
        return self._submit(_Transfer(tag, bytes(peer), views, nbytes, timeout, keep=buffers))

    def _block_views(self, block_ids: Sequence[int]) -> tuple[list[tuple[int, Any]], int]:
        views = [(i, self._views[b]) for i, b in enumerate(block_ids)]
        return views, len(views) * self._block_nbytes

    def _buffer_views(
        self, buffers: Sequence[tuple[int, torch.Tensor]]
    ) -> tuple[list[tuple[int, Any]], int]:
        views = []
        for index, buffer in buffers:
            if not buffer.is_contiguous():
                raise ValueError("buffers: must be contiguous")
            raw = buffer.detach().view(torch.uint8).reshape(-1)
            views.append((index, self._array(raw.numpy() if raw.device.type == "cpu" else raw)))
        return views, sum(b.numel() * b.element_size() for _, b in buffers)

    def check_peer(self, peer: bytes) -> None:
        _unseal(peer)

    def cancel(self, tag: int) -> None:
        self._enqueue(("abort", tag, "cancelled"))

    def close(self) -> None:
        """Fail what is pending (see the module docstring), then release endpoints, worker
        and context, and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.append(("close",))
            os.eventfd_write(self._wake_fd, 1)
        if threading.current_thread() is not self._thread:
            self._thread.join(ABORT_GRACE_S + 5)

    # ---- caller side

    def _num_blocks(self) -> int:
        if not self._views:
            raise KvTransferError("register_pool must be called before a transfer")
        return len(self._views)

    def _submit(self, t: _Transfer) -> Future[TransferResult]:
        t.future.set_running_or_notify_cancel()  # only cancel(tag) may cancel
        if not self._enqueue(("start", t)):
            t.future.set_exception(KvTransferError(f"{t.name}: transport closed"))
        return t.future

    def _enqueue(self, command: tuple[Any, ...]) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._commands.append(command)
            os.eventfd_write(self._wake_fd, 1)
        return True

    # ---- the transport thread

    def _run(self, ready: threading.Event) -> None:
        ucx = self._ucx
        try:
            context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
            worker = ucx.UCXWorker(context)
            worker.init_blocking_progress_mode()
            self._address = _seal(bytes(worker.address))
            self.same_host, self._same_host_level = _same_host(context)
        except Exception as e:
            self._startup_error = e
            with self._lock:
                self._closed = True
                os.close(self._wake_fd)
            ready.set()
            return
        self._worker = worker
        ready.set()
        try:
            self._loop(worker)
        except BaseException as e:
            log.exception("kv transfer thread failed")
            for t in list(self._transfers.values()):
                t.failure = t.failure or f"transport thread failed: {e!r}"
                self._finish(t, time.monotonic())
        finally:
            with self._lock:
                self._closed = True
                os.close(self._wake_fd)
            for command in self._commands:  # queued while the thread was stopping
                if command[0] == "start":
                    command[1].future.set_exception(
                        KvTransferError(f"{command[1].name}: transport closed")
                    )
            self._transfers.clear()
            for ep in [*self._endpoints.values(), *self._idle_groups]:
                ep.close_blocking()
            self._endpoints.clear()
            self._idle_groups.clear()
            # The last references to the worker and context go on this thread.
            self._worker = None
            del worker, context

    def _loop(self, worker: Any) -> None:
        poller = select.poll()
        poller.register(worker.epoll_file_descriptor, select.POLLIN)
        poller.register(self._wake_fd, select.POLLIN)
        busy_until = 0.0
        closing = False
        while True:
            while self._commands:
                closing |= self._command(self._commands.popleft())
                busy_until = time.monotonic() + SPIN_S
            self._progress(worker)
            now = time.monotonic()
            changed = self._poll_transfers(now)
            if self._poll_retiring(now) or changed:
                busy_until = now + SPIN_S
            if closing and not self._transfers:
                return
            if self._commands or (self._transfers and now < busy_until):
                # Poll, but let any runnable thread go first: on a loaded machine the peer
                # process needs this core to answer (measured on 2 cores under load: 0.3 GB/s
                # without the yield, 3-4 GB/s with it).
                os.sched_yield()
                continue
            if not worker.arm():  # events are pending: progress again
                os.sched_yield()
                continue
            deadlines = [self._next_deadline(t) for t in self._transfers.values()]
            deadlines += [close_at for _, _, close_at, _ in self._retiring]
            wait = min(min(deadlines, default=math.inf) - now, IDLE_WAKE_S)
            poller.poll(max(0, math.ceil(wait * 1000)))
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)

    @staticmethod
    def _progress(worker: Any) -> None:
        # `progress()` loops until UCX runs dry, which during a large transfer means until it
        # ends: step instead, so commands and deadlines are seen in between.
        for _ in range(PROGRESS_STEPS):
            if not worker.progress_once():
                worker.progress()  # also runs ucxx's deferred cancellations; cheap when idle
                return

    def _command(self, command: tuple[Any, ...]) -> bool:
        """Run one queued command; True when it is the close."""
        now = time.monotonic()
        if command[0] == "start":
            self._start(command[1])
            return False
        if command[0] == "abort":
            tags, why = {command[1]}, command[2]
        else:
            tags, why = {t.tag for t in self._transfers.values()}, "transport closed"
        for t in [t for t in self._transfers.values() if t.tag in tags]:
            self._advance(t, now)
            if t.failure is None and t.done == len(t.requests):
                self._finish(t, now)  # every block was already in place: too late to cancel
            else:
                self._abort(t, why, now)
        if command[0] == "close":
            for peer, ep in list(self._endpoints.items()):
                self._close_endpoint(peer, ep, why, now)
            for ep, peer, _, _ in self._retiring:
                self._close_endpoint(peer, ep, why, now)
            self._retiring.clear()
        return command[0] == "close"

    def _start(self, t: _Transfer) -> None:
        key = (t.tag, t.peer)
        if key in self._transfers:
            t.future.set_exception(KvTransferError(f"{t.name}: tag already in use"))
            return
        self._transfers[key] = t
        ucx = self._ucx
        try:
            if t.peer is None:
                t.group = self._receive_group()
                post = t.group.tag_recv
            else:
                t.endpoint = self._endpoint(t.peer)
                post = t.endpoint.tag_send
            for i, view in t.views:
                t.requests.append(post(view, ucx.UCXXTag(t.tag | i)))
        except Exception as e:
            self._abort(t, f"posting failed: {type(e).__name__}: {e}", time.monotonic())

    def _receive_group(self) -> Any:
        """An endpoint to this worker itself that nothing is sent on, to post one transfer's
        receives through: ucxx tracks requests by endpoint, and closing it cancels in UCX the
        ones still posted (and only them). A finished transfer's group is used again."""
        if self._idle_groups:
            return self._idle_groups.pop()
        return self._worker.create_endpoint_from_worker_address(self._worker.address, False)

    def _endpoint(self, peer: bytes) -> Any:
        ep = self._endpoints.get(peer)
        if ep is not None and not ep.alive:
            self._close_endpoint(peer, ep, "the peer failed", time.monotonic())
            ep = None
        if ep is None:
            for other, dead in [(p, e) for p, e in self._endpoints.items() if not e.alive]:
                self._close_endpoint(other, dead, "the peer failed", time.monotonic())
            address = self._ucx.UCXAddress.create_from_buffer(_unseal(peer))
            ep = self._worker.create_endpoint_from_worker_address(address, True)
            self._endpoints[peer] = ep
        return ep

    def _close_endpoint(self, peer: bytes, ep: Any, why: str, now: float) -> None:
        """Force-close `ep`: sends outstanding on it complete as cancelled, and fail."""
        if self._endpoints.get(peer) is ep:
            del self._endpoints[peer]
        for t in self._transfers.values():
            if t.endpoint is not ep:
                continue
            _, error = self._scan(t)
            if t.failure is None and (error is not None or t.done < len(t.requests)):
                t.failure = error or f"endpoint to the peer closed: {why}"
            t.give_up_at = min(t.give_up_at, now + ABORT_GRACE_S)
        ep.close_blocking()

    def _retire_endpoint(self, peer: bytes, ep: Any, why: str, now: float) -> None:
        """Take `ep` out of the cache and close it once the other sends on it are done (or at
        the latest after ABORT_GRACE_S), so aborting one send rarely fails its siblings."""
        if self._endpoints.get(peer) is ep:
            del self._endpoints[peer]
        if all(e is not ep for e, _, _, _ in self._retiring):
            self._retiring.append((ep, peer, now + ABORT_GRACE_S, why))

    def _poll_retiring(self, now: float) -> bool:
        closing = [
            r
            for r in self._retiring
            if now >= r[2]
            or not any(t.endpoint is r[0] and t.failure is None for t in self._transfers.values())
        ]
        for entry in closing:
            self._retiring.remove(entry)
            ep, peer, _, why = entry
            self._close_endpoint(peer, ep, why, now)
        return bool(closing)

    def _next_deadline(self, t: _Transfer) -> float:
        return t.give_up_at if t.failure is not None else t.deadline

    def _scan(self, t: _Transfer) -> tuple[bool, str | None]:
        """Move `t.done` past completed requests: (moved, the first new failure if any)."""
        reqs, i = t.requests, t.done
        error = None
        while i < len(reqs) and reqs[i].completed:
            if error is None and t.failure is None and reqs[i].status != 0:
                try:
                    reqs[i].check_error()
                    error = f"block {i}: UCX status {reqs[i].status}"
                except Exception as e:
                    error = f"block {i}: {type(e).__name__}: {e}"
            i += 1
        moved = i != t.done
        t.done = i
        return moved, error

    def _advance(self, t: _Transfer, now: float) -> bool:
        moved, error = self._scan(t)
        if error is not None:
            self._abort(t, error, now)
        return moved

    def _poll_transfers(self, now: float) -> bool:
        """Complete, time out or give up on transfers; True if anything changed."""
        changed = False
        for t in list(self._transfers.values()):
            changed |= self._advance(t, now)
            if t.done == len(t.requests):
                self._finish(t, now)
            elif t.failure is None and now >= t.deadline:
                self._abort(t, f"timed out after {t.timeout:g} s", now)
            elif t.failure is not None and now >= t.give_up_at:
                t.failure += f" (gave up waiting for {len(t.requests) - t.done} blocks)"
                self._finish(t, now)
            else:
                continue
            changed = True
        return changed

    def _abort(self, t: _Transfer, why: str, now: float) -> None:
        if t.failure is not None:
            return
        t.failure = why
        if t.peer is None:
            t.give_up_at = now + ABORT_GRACE_S
            self._close_group(t)
        elif t.endpoint is None or t.done == len(t.requests):
            t.give_up_at = now
        elif not t.endpoint.alive:  # the peer failed: its other sends are lost anyway
            self._close_endpoint(t.peer, t.endpoint, f"{t.name} failed ({why})", now)
        else:  # the give-up clock starts when the endpoint closes
            self._retire_endpoint(t.peer, t.endpoint, f"{t.name} was aborted ({why})", now)

    @staticmethod
    def _close_group(t: _Transfer) -> None:
        """Cancel the receives of `t` that no message has matched (matched ones go on)."""
        group, t.group = t.group, None
        if group is not None:
            group.close_blocking()

    def _finish(self, t: _Transfer, now: float) -> None:
        del self._transfers[(t.tag, t.peer)]
        t.requests = []
        t.endpoint = None
        t.keep = None
        if t.group is not None and t.failure is None:
            self._idle_groups.append(t.group)  # every receive on it has completed
            t.group = None
        self._close_group(t)  # still open after a failure only if the loop itself failed
        if t.failure is None:
            t.future.set_result(TransferResult(len(t.views), t.nbytes, now - t.start))
        else:
            t.future.set_exception(KvTransferError(f"{t.name}: {t.failure}"))
