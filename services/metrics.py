"""Prometheus metrics of a worker process, served on its `/metrics` (vLLM's shapes with a
`pdserve_` prefix). Gauges read the engine's state when scraped; counters and histograms are
fed on the request's path (KV transfers on both sides of a handoff)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine
    from pdserve.common.model_runner import ModelRunner
    from pdserve.common.request import Request

LABELS = ("model", "role", "worker")
# From a few blocks over shared memory to thousands over TCP.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# A gauge, so no `_total` suffix (promtool's lint keeps that for counters).
KV_BLOCKS_TOTAL = Gauge("pdserve_kv_cache_num_blocks", "KV cache blocks in the pool", LABELS)
KV_BLOCKS_FREE = Gauge(
    "pdserve_kv_cache_blocks_free", "KV cache blocks free (cached-but-unused count as free)", LABELS
)
KV_USAGE = Gauge("pdserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use", LABELS)
RUNNING = Gauge("pdserve_num_requests_running", "Requests in the running batch", LABELS)
WAITING = Gauge(
    "pdserve_num_requests_waiting", "Requests waiting for a batch slot or KV blocks", LABELS
)
HELD = Gauge(
    "pdserve_kv_leases_held", "Prefilled requests whose KV blocks wait to be pulled", LABELS
)
REFUSED = Counter(
    "pdserve_requests_refused",
    "Requests refused before any work: max_pending (queue full), ttft_target (the first "
    "token would miss --ttft-target-ms), unknown_prefill_worker (a KV handle naming an "
    "address this worker does not know), draining (a decode worker moving its streams out)",
    (*LABELS, "reason"),
)
MIGRATED = Counter(
    "pdserve_kv_streams_migrated",
    "Running streams this decode worker handed, with their KV under a lease, to another "
    "decode worker as it drained (live migration)",
    LABELS,
)
# The status stream (`services/status.py`): its bounds at work.
STATUS_RESYNCS = Counter(
    "pdserve_status_resyncs",
    "Status-stream watchers that fell a full queue of reports behind: their backlog was "
    "dropped and a fresh snapshot sent instead",
    LABELS,
)
STATUS_WATCHERS = Gauge(
    "pdserve_status_watchers",
    "Status streams open now: the coordinators routing to this worker",
    LABELS,
)
STATUS_WATCHERS_REFUSED = Counter(
    "pdserve_status_watchers_refused",
    "Status-stream watchers refused (RESOURCE_EXHAUSTED): the most allowed already watch",
    LABELS,
)
# Counters as vLLM shapes them (tokens); fed by deltas of the scheduler's running counts.
PREFIX_QUERIES = Counter(
    "pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", LABELS
)
PREFIX_HITS = Counter(
    "pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", LABELS
)
PREEMPTIONS = Counter(
    "pdserve_num_preemptions",
    "Running requests preempted for KV blocks, by mode: swap (their blocks kept for the KV "
    "tiers) or recompute",
    (*LABELS, "mode"),
)
TRANSFER_LABELS = (*LABELS, "transport", "direction")
KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes", "KV bytes moved between workers", TRANSFER_LABELS
)
KV_TRANSFER_BLOCKS = Counter(
    "pdserve_kv_transfer_blocks", "KV blocks moved between workers", TRANSFER_LABELS
)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Time of one KV transfer, from posting to every block in place (or sent)",
    TRANSFER_LABELS,
    buckets=TRANSFER_BUCKETS,
)
# Per-request phase times; buckets from GPU milliseconds to CPU minutes.
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                 80.0, 160.0, 320.0, 640.0)  # fmt: skip
QUEUE_TIME = Histogram(
    "pdserve_request_queue_time_seconds",
    "Arrival at the worker to the first batch it runs in (on decode: admission and KV pull)",
    LABELS, buckets=PHASE_BUCKETS,
)  # fmt: skip
PREFILL_TIME = Histogram(
    "pdserve_request_prefill_time_seconds", "First batch to the first token (prefill workers)",
    LABELS, buckets=PHASE_BUCKETS,
)  # fmt: skip
DECODE_TIME = Histogram(
    "pdserve_request_decode_time_seconds", "Joining the batch to the last token (decode workers)",
    LABELS, buckets=PHASE_BUCKETS,
)  # fmt: skip
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures",
    "KV transfers that failed, were cancelled or timed out",
    TRANSFER_LABELS,
)


class MoeRoutingCollector(Collector):
    """Tokens the router of each MoE layer sent to each expert on this worker
    (`pdserve_moe_expert_tokens_total{layer, expert}`: sum the ranks of a group for the
    group's load) and, per layer, the group's busiest rank's tokens over the mean rank's
    (`pdserve_moe_expert_load_imbalance`; 1.0 is even); with expert parallelism also the
    all-to-all bytes sent and the redundant experts' re-placements. Read from the engine's
    counters when scraped: one copy of a [layers, experts] table, no Python work per step."""

    def __init__(self, runner: ModelRunner, labels: dict[str, str]) -> None:
        self.runner = runner
        self.labels = labels
        self.moe_layers = [block.layer for block in runner.model.moe_blocks()]

    def collect(self) -> Iterator[Metric]:
        counts = self.runner.expert_token_counts()
        if counts is None:
            return
        names, values = [*self.labels, "layer", "expert"], [*self.labels.values()]
        tokens = CounterMetricFamily(
            "pdserve_moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer (top-k: k per token)",
            labels=names,
        )
        for layer in self.moe_layers:
            for expert, n in enumerate(counts[layer].tolist()):
                tokens.add_metric([*values, str(layer), str(expert)], n)
        yield tokens
        ratio = GaugeMetricFamily(
            "pdserve_moe_expert_load_imbalance",
            "Per MoE layer: the busiest expert-parallel rank's routed tokens over the mean",
            labels=[*self.labels, "layer"],
        )
        imbalance = self.runner.expert_imbalance()
        if imbalance is not None:
            for layer in self.moe_layers:
                ratio.add_metric([*values, str(layer)], float(imbalance[layer]))
        yield ratio
        if self.runner.config.expert_parallel < 2:
            return
        balance = self.runner.expert_balance
        for name, text, value in [
            ("pdserve_moe_alltoall_bytes", "Bytes this rank sent to other ranks in the MoE "
             "layers' all-to-all (dispatch and combine)", balance.traffic.bytes_sent),
            ("pdserve_moe_expert_rebalances", "Re-placements of the redundant experts",
             balance.rebalances),
            ("pdserve_moe_expert_copies_moved", "Expert copies moved between ranks by "
             "re-placements", balance.experts_moved),
        ]:  # fmt: skip
            family = CounterMetricFamily(name, text, labels=list(self.labels))
            family.add_metric(values, value)
            yield family


class KvOffloadCollector(Collector):
    """The KV tiers below the pool, labelled `tier`: `host` (`--kv-host-offload-gb`),
    `disk` (`--kv-offload-dir`, this worker's own) and `shared` (`--kv-shared-dir`). Read
    from their counts when scraped: tokens served from each, blocks stored and evicted, bytes
    and seconds of reads and writes, usage."""

    def __init__(self, engine: LLMEngine, labels: dict[str, str]) -> None:
        self.kv = engine.kv_cache
        self.block_size = engine.kv_cache.block_size
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        kv = self.kv
        named = (("host", kv.tiers.host), ("disk", kv.tiers.disk), ("shared", kv.tiers.shared))
        tiers = [(name, tier) for name, tier in named if tier is not None]
        names = [*self.labels, "tier"]
        counters = [
            ("pdserve_kv_offload_hits", "Prompt tokens read back from a tier into the pool "
             "(also counted in pdserve_prefix_cache_hits_total)",
             lambda t: t.stats.hits * self.block_size),
            ("pdserve_kv_offload_stores", "KV blocks written to a tier", lambda t: t.stats.stores),
            ("pdserve_kv_offload_store_bytes", "Bytes written to a tier",
             lambda t: t.stats.store_bytes),
            ("pdserve_kv_offload_store_seconds", "Seconds spent writing blocks",
             lambda t: t.stats.store_seconds),
            ("pdserve_kv_offload_loads", "KV blocks read from a tier", lambda t: t.stats.loads),
            ("pdserve_kv_offload_load_bytes", "Bytes read from a tier",
             lambda t: t.stats.load_bytes),
            ("pdserve_kv_offload_load_seconds", "Seconds spent reading blocks",
             lambda t: t.stats.load_seconds),
            ("pdserve_kv_offload_evictions", "Blocks deleted from a tier to stay within its "
             "size", lambda t: t.stats.evictions),
            ("pdserve_kv_offload_dropped", "Blocks not stored because too many waited to be "
             "written", lambda t: t.stats.dropped),
            ("pdserve_kv_offload_corrupt", "Blocks on disk that failed their checksum or size "
             "check (treated as misses and deleted)", lambda t: t.stats.corrupt),
        ]  # fmt: skip
        gauges = [
            ("pdserve_kv_offload_used_bytes", "Bytes of KV blocks in a tier (as this worker "
             "knows it)", lambda t: t.used_bytes),
            ("pdserve_kv_offload_capacity_bytes", "A tier's size (--kv-host-offload-gb, "
             "--kv-offload-gb, --kv-shared-gb)", lambda t: t.capacity_bytes),
            ("pdserve_kv_offload_blocks", "KV blocks held by a tier (on disk or being written)",
             lambda t: t.num_blocks()),
        ]  # fmt: skip
        for kind, specs in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
            for name, text, read in specs:
                family = kind(name, text, labels=names)
                for tier_name, tier in tiers:
                    family.add_metric([*self.labels.values(), tier_name], read(tier))
                yield family


class WorkerMetrics:
    """The metrics of one worker, labelled once."""

    def __init__(self, engine: LLMEngine, role: str, worker: str, model: str) -> None:
        labels = {"model": model, "role": role, "worker": worker}
        self.labels = labels
        kv = engine.kv_cache
        sched = engine.scheduler
        KV_BLOCKS_TOTAL.labels(**labels).set(engine.runner.num_blocks)
        KV_BLOCKS_FREE.labels(**labels).set_function(lambda: kv.num_free_blocks)
        KV_USAGE.labels(**labels).set_function(kv.usage)
        RUNNING.labels(**labels).set_function(lambda: len(sched.running))
        # Waiting: for the batch, or (decode) for blocks to pull a handoff's KV into.
        WAITING.labels(**labels).set_function(
            lambda: len(sched.waiting) + len(sched.remote.pending)
        )
        HELD.labels(**labels).set_function(lambda: len(sched.leases))
        self._stats = sched.stats
        self._prefix_queries = PREFIX_QUERIES.labels(**labels)
        self._prefix_hits = PREFIX_HITS.labels(**labels)
        self._seen_queries = self._seen_hits = 0
        self._preempted = {m: PREEMPTIONS.labels(**labels, mode=m) for m in ("swap", "recompute")}
        self._seen_preemptions = {"swap": 0, "recompute": 0}
        self.sync_prefix_cache()
        if engine.runner.expert_counter is not None:
            REGISTRY.register(MoeRoutingCollector(engine.runner, labels))
        if engine.kv_cache.tiers:
            REGISTRY.register(KvOffloadCollector(engine, labels))

    def refused(self, reason: str) -> None:
        REFUSED.labels(**self.labels, reason=reason).inc()

    def migrated(self, streams: int) -> None:
        MIGRATED.labels(**self.labels).inc(streams)

    def sync_prefix_cache(self) -> None:
        """Add what the prefix cache and preemptions counted since the last call (the engine
        thread calls this between steps, so the counters trail the engine by at most one
        step)."""
        queries, hits = self._stats.prefix_cache_queries, self._stats.prefix_cache_hits
        self._prefix_queries.inc(queries - self._seen_queries)
        self._prefix_hits.inc(hits - self._seen_hits)
        self._seen_queries, self._seen_hits = queries, hits
        swapped = self._stats.num_preemptions_swapped
        for mode, n in (("swap", swapped), ("recompute", self._stats.num_preemptions - swapped)):
            self._preempted[mode].inc(n - self._seen_preemptions[mode])
            self._seen_preemptions[mode] = n

    def request_done(self, request: Request) -> None:
        """A request's phases on this worker, once it is done here."""
        if request.scheduled_time is None:
            return
        end = request.finish_time or time.monotonic()
        QUEUE_TIME.labels(**self.labels).observe(request.scheduled_time - request.arrival_time)
        phase = PREFILL_TIME if self.labels["role"] == "prefill" else DECODE_TIME
        phase.labels(**self.labels).observe(end - request.scheduled_time)

    def transfer(self, transport: str, direction: str, blocks: int, nbytes: int, s: float) -> None:
        labels = {**self.labels, "transport": transport, "direction": direction}
        KV_TRANSFER_BYTES.labels(**labels).inc(nbytes)
        KV_TRANSFER_BLOCKS.labels(**labels).inc(blocks)
        KV_TRANSFER_SECONDS.labels(**labels).observe(s)

    def transfer_failed(self, transport: str, direction: str) -> None:
        KV_TRANSFER_FAILURES.labels(**self.labels, transport=transport, direction=direction).inc()
