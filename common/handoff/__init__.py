"""The KV handoff: how a request prefilled on one worker goes on decoding on another.

Read top to bottom, a handoff is:

1. prefill (`sender.py`, `KvSender`): the prompt runs as a prefill-only request; its blocks
   stay allocated (PREFILLED) and `grant` leases them (`leases.py`), which makes the
   `KvHandle` (`handle.py`) that travels with the first token;
2. decode (`receiver.py`, `KvReceiver`): `check` the handle against this worker's layout,
   then `arrive` (the request's one call into the engine thread): the request is made, its
   output state brought to where prefill left it, and it joins the scheduler's line of
   requests waiting for remote KV (`remote_queue.py`), which reserves blocks when they fit,
   reusing this worker's cached prefix;
3. `pull`: receives are posted into the reserved blocks after the cached ones and the
   prefill worker is asked to send (a `TransferOrder` over a `PrefillLink`: gRPC between
   processes, `local_link.py` in one), whole blocks or, with tensor parallelism on either
   side, head slices rank to rank (`slices.py`);
4. the sender ends the lease once the send settles; the receiver reports the pull
   `landed` (or `abandon`s the request). Both only mark it: the next engine step frees the
   lease's blocks, starts the landed request in the running batch, gives back an abandoned
   one's blocks, and expires leases nobody pulled (`Scheduler.settle_handoffs`).

The bytes move through `common/kv_transfer` (UCX between processes, in-process for tests).
gRPC, status codes and spans stay in the servicers (`services/prefill`, `services/decode`),
which convert protobuf to these types (`services/handoff_proto.py`)."""
