"""Colocated mode: one engine does both prefill and decode behind the public
`GenerateService` (the coordinator calls it with token ids). No KV moves; it is the
baseline disaggregation must beat, and the right choice on one small device."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from transformers import AutoTokenizer

from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.services.convert import logprobs_to_proto
from pdserve.services.frontend import Frontend, usage
from pdserve.services.worker import Worker
from pdserve.v1 import generate_pb2, generate_pb2_grpc


class ColocatedServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        engine = worker.loop.engine
        # Its own tokenizer: the engine thread's is busy detokenizing, and a Rust-backed
        # tokenizer used from two threads at once can fail with "Already borrowed".
        self.frontend = Frontend(
            AutoTokenizer.from_pretrained(engine.model_dir),
            engine.runner.hf_config.vocab_size,
            engine.max_model_len,
        )

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        loop = self.worker.loop
        try:
            parsed = await self.frontend.parse_async(request)
            await loop.add(parsed.token_ids, parsed.params, parsed.request_id)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WorkerBusyError as e:
            await self.worker.refuse_busy(context, e)
        prompt_sent = False
        async for out in loop.stream(parsed.request_id):
            response = generate_pb2.GenerateResponse(
                request_id=parsed.request_id,
                token_ids=out.new_token_ids,
                text=out.new_text,
                logprobs=logprobs_to_proto(out.new_logprobs),
            )
            if out.prompt_logprobs is not None and not prompt_sent:
                response.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
                prompt_sent = True
            if out.finished:
                response.finish_reason = out.finish_reason or "abort"
                response.usage.CopyFrom(
                    usage(out.prompt_tokens, len(out.token_ids), out.cached_tokens)
                )
            yield response
