"""Prometheus metrics of one server, in a registry the app owns (names prefixed `jaxtier_`).

Per-request counters and latency histograms (time to first token, inter-token latency, end to end)
are observed by the HTTP layer as updates stream through `track`; the engine's figures (queue,
KV blocks per tier, swaps, preemptions, model steps, weight bytes streamed from the host, the host
link's bytes by tier and their overlap with compute) are read from the engine's last step when
`/metrics` is scraped.
"""

import time
from typing import AsyncIterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxtier.engine.engine import RequestUpdate
from jaxtier.server.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

_GAUGES = (  # (name, help, key of the engine's stats)
    ("jaxtier_requests_running", "requests holding device KV blocks", "running"),
    ("jaxtier_requests_waiting", "requests queued for admission", "waiting"),
    ("jaxtier_requests_swapped", "preempted requests whose KV is in the host pool", "swapped"),
    ("jaxtier_kv_device_blocks_total", "blocks of the device KV pool", "device_blocks_total"),
    ("jaxtier_kv_host_blocks_total", "blocks of the pinned-host KV pool", "host_blocks_total"),
    ("jaxtier_kv_device_blocks_cached", "device KV blocks held by the prefix cache (shared or "
     "evictable)", "device_blocks_cached"),
    ("jaxtier_kv_host_blocks_cached", "host KV blocks held by the prefix cache's host tier",
     "host_blocks_cached"),
    ("jaxtier_kv_host_blocks_swapped", "host KV blocks held by swapped-out requests",
     "host_blocks_swapped"),
)
_COUNTERS = (
    ("jaxtier_model_steps", "engine steps run", "steps"),
    ("jaxtier_model_calls", "model programs run (prefill and decode calls)",
     "model_calls"),
    ("jaxtier_swap_out", "swap-outs (device -> host)", "swap_out_count"),
    ("jaxtier_swap_in", "swap-ins (host -> device)", "swap_in_count"),
    ("jaxtier_swap_out_bytes", "KV bytes swapped out", "swap_out_bytes"),
    ("jaxtier_swap_in_bytes", "KV bytes swapped in", "swap_in_bytes"),
    ("jaxtier_swap_seconds", "time the swap programs took (measured off the engine thread)",
     "swap_seconds"),
    ("jaxtier_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
     "prefix_query_tokens"),
)


class _EngineCollector:
  """Reads the engine's figures as of its last step, at scrape time."""

  def __init__(self, engine: AsyncEngine, weight_bytes_per_call: int):
    self._engine, self._weight_bytes_per_call = engine, weight_bytes_per_call

  def collect(self):
    stats = self._engine.stats()
    figures = stats.engine
    for name, text, key in _GAUGES:
      yield GaugeMetricFamily(name, text, value=figures[key])
    yield GaugeMetricFamily("jaxtier_kv_device_blocks_used", "device KV blocks requests use "
                            "(cached blocks no request uses count as free)",
                            value=figures["device_blocks_total"] - figures["device_blocks_free"])
    yield GaugeMetricFamily("jaxtier_kv_host_blocks_used", "host KV blocks in use",
                            value=figures["host_blocks_total"] - figures["host_blocks_free"])
    yield GaugeMetricFamily("jaxtier_ready", "1 once an ordinary request's programs are compiled "
                            "(/health 200; the rest of the warm-up may still run)",
                            value=int(getattr(self._engine, "ready", stats.ready)))
    done, total = self._engine.warmup_progress
    yield GaugeMetricFamily("jaxtier_warmup_programs_compiled", "programs warm-up has compiled "
                            "so far (of jaxtier_warmup_programs)", value=done)
    yield GaugeMetricFamily("jaxtier_warmup_programs", "programs warm-up compiles in all (0 "
                            "before it starts or without warm-up)", value=total)
    yield GaugeMetricFamily("jaxtier_warmup_failed", "1 if warm-up failed (/health says why)",
                            value=int(self._engine.warmup_error is not None))
    # read from the runner now where there is one: the warm-up compiles between steps
    runner = getattr(getattr(self._engine, "engine", None), "runner", None)
    compiled, hits, seconds = ((runner.compiled_programs, runner.cache_hits,
                                runner.compile_seconds) if runner is not None else
                               (figures["compiled_programs"], figures["compile_cache_hits"],
                                figures["compile_seconds"]))
    yield CounterMetricFamily("jaxtier_compile_programs_compiled", "programs compiled since the "
                              "start (not found in the persistent compilation cache)",
                              value=compiled)
    yield CounterMetricFamily("jaxtier_compile_cache_hits", "programs loaded from the persistent "
                              "compilation cache since the start", value=hits)
    yield CounterMetricFamily("jaxtier_compile_seconds", "seconds spent compiling or loading "
                              "programs since the start", value=seconds)
    for name, text, key in _COUNTERS:
      yield CounterMetricFamily(name, text, value=figures[key])
    preemptions = CounterMetricFamily("jaxtier_preemptions", "requests preempted, by mode",
                                      labels=["mode"])
    for mode, count in sorted(figures["preemptions"].items()):
      preemptions.add_metric([mode], count)
    yield preemptions
    hits = CounterMetricFamily("jaxtier_prefix_cache_hits", "prompt tokens found in the prefix "
                               "cache, by tier", labels=["tier"])
    rates = GaugeMetricFamily("jaxtier_prefix_cache_hit_rate", "hit tokens over looked-up tokens "
                              "since the start, by tier", labels=["tier"])
    for tier in ("device", "host"):
      hits.add_metric([tier], figures[f"prefix_{tier}_hit_tokens"])
      rates.add_metric([tier], figures[f"prefix_{tier}_hit_rate"])
    yield hits
    yield rates
    moved = CounterMetricFamily("jaxtier_prefix_cache_host_bytes", "KV bytes the host tier of the "
                                "prefix cache moved: writeback (device -> host), load (host -> "
                                "device)", labels=["direction"])
    moved.add_metric(["writeback"], figures["prefix_writeback_bytes"])
    moved.add_metric(["load"], figures["prefix_load_bytes"])
    yield moved
    yield from _link_metrics(figures)
    if figures.get("kv_disk_path") is not None:
      yield from _disk_metrics(figures)
    yield CounterMetricFamily(
        "jaxtier_weight_transfer_bytes", "weight bytes streamed from host memory to the device "
        "(host-resident weight bytes per model call times model calls)",
        value=figures["model_calls"] * self._weight_bytes_per_call)


_DISK_COUNTERS = (  # (name, help, key of the engine's stats): the disk tier's
    ("jaxtier_disk_hit_blocks", "prefix blocks read from the disk tier", "disk_hit_blocks"),
    ("jaxtier_disk_hit_tokens", "prompt tokens read from the disk tier", "disk_hit_tokens"),
    ("jaxtier_disk_read_bytes", "bytes read from the disk tier", "disk_read_bytes"),
    ("jaxtier_disk_read_seconds", "seconds the disk tier's reads took", "disk_read_seconds"),
    ("jaxtier_disk_written_bytes", "bytes written to the disk tier", "disk_bytes_written"),
    ("jaxtier_disk_evictions", "disk tier files removed past kv_disk_gb", "disk_evictions"),
    ("jaxtier_disk_corrupt_files", "disk tier files that failed their checks (removed, "
     "recomputed)", "disk_corrupt_files"),
    ("jaxtier_disk_write_errors", "disk tier write errors (writing stops at the first)",
     "disk_write_errors"),
)


def _disk_metrics(figures: dict):
  """The disk tier's traffic, queue and faults (`jaxtier.engine.disk_tier`)."""
  for name, text, key in _DISK_COUNTERS:
    yield CounterMetricFamily(name, text, value=figures[key])
  yield GaugeMetricFamily("jaxtier_disk_write_queue", "blocks waiting for the disk tier's writer",
                          value=figures["disk_write_queue"])
  yield GaugeMetricFamily("jaxtier_disk_blocks", "blocks in the disk tier's namespace",
                          value=figures["disk_blocks"])


def _link_metrics(figures: dict):
  """The host link's traffic and its overlap with compute (`jaxtier.engine.link`)."""
  moved = CounterMetricFamily("jaxtier_link_bytes", "bytes moved over the host link, by tier: "
                              "swap_in, prefix_load, weight_prefetch (host -> device), swap_out, "
                              "prefix_writeback (device -> host)", labels=["tier"])
  for tier, nbytes in sorted(figures["link_bytes"].items()):
    moved.add_metric([tier], nbytes)
  yield moved
  yield CounterMetricFamily("jaxtier_link_seconds", "link seconds of those bytes (measured swap "
                            "seconds per block, else the measured rates)",
                            value=figures["link_seconds"])
  yield CounterMetricFamily("jaxtier_link_hidden_seconds", "link seconds within their steps' "
                            "(modeled) compute", value=figures["link_hidden_seconds"])
  yield CounterMetricFamily("jaxtier_link_stall_seconds", "link seconds beyond their steps' "
                            "(modeled) compute", value=figures["link_stall_ms"] / 1e3)
  yield CounterMetricFamily("jaxtier_link_stalled_steps", "steps whose link time passed their "
                            "compute", value=figures["link_stalled_steps"])
  if figures["link_hidden_fraction"] is not None:
    yield GaugeMetricFamily("jaxtier_link_hidden_fraction", "share of the link seconds hidden "
                            "behind compute since the start", value=figures["link_hidden_fraction"])
  rates = GaugeMetricFamily("jaxtier_link_bytes_per_second", "the host link's bandwidth measured "
                            "at start-up, by direction", labels=["direction"])
  for direction in ("h2d", "d2h"):
    rate = figures.get(f"link_{direction}_bytes_per_s")
    if rate is not None:
      rates.add_metric([direction], rate)
  yield rates
  budget = figures.get("link_budget_bytes_per_step")
  if budget is not None:
    yield GaugeMetricFamily("jaxtier_link_budget_bytes_per_step", "host -> device bytes a step's "
                            "compute hides: the scheduler's link budget", value=budget)
    yield GaugeMetricFamily("jaxtier_kv_link_budget_bytes_per_step", "the part of it KV "
                            "swap-ins and prefix loads may spend (the rest: weight prefetch)",
                            value=figures["kv_link_budget_bytes_per_step"])


class ServerMetrics:
  """The metrics of one app and the registry that holds them."""

  def __init__(self, engine: AsyncEngine):
    self.registry = CollectorRegistry()
    report = engine.llm.memory_report()
    self.finished = Counter("jaxtier_requests_finished", "finished requests by finish reason",
                            ["finish_reason"], registry=self.registry)
    self.prompt_tokens = Counter("jaxtier_prompt_tokens", "prompt tokens prefilled",
                                 registry=self.registry)
    self.generation_tokens = Counter("jaxtier_generation_tokens", "tokens generated",
                                     registry=self.registry)
    self.ttft = Histogram("jaxtier_time_to_first_token_seconds", "arrival to first token",
                          buckets=LATENCY_BUCKETS, registry=self.registry)
    self.e2e = Histogram("jaxtier_e2e_request_latency_seconds", "arrival to last token",
                         buckets=LATENCY_BUCKETS, registry=self.registry)
    self.itl = Histogram("jaxtier_inter_token_latency_seconds", "time between a request's tokens",
                         buckets=TOKEN_BUCKETS, registry=self.registry)
    for key, name in (("device_weight_bytes", "jaxtier_device_weight_bytes"),
                      ("host_weight_bytes", "jaxtier_host_weight_bytes"),
                      ("device_kv_bytes", "jaxtier_device_kv_cache_bytes"),
                      ("host_kv_bytes", "jaxtier_host_kv_cache_bytes")):
      Gauge(name, f"memory_report()['{key}']", registry=self.registry).set(report[key])
    self.registry.register(_EngineCollector(engine, report["weight_transfer_bytes_per_step"]))

  def render(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)

  async def track(self, updates: AsyncIterator[RequestUpdate], prompt_len: int, arrival: float
                  ) -> AsyncIterator[RequestUpdate]:
    """Passes a request's updates through, counting tokens, latencies and how it ended.

    A stream closed before its last update counts as finished with reason "abort".
    """
    self.prompt_tokens.inc(prompt_len)
    last, reason = None, "abort"
    try:
      async for update in updates:
        if update.new_token_ids:
          now = time.monotonic()
          if last is None:
            self.ttft.observe(now - arrival)
          else:
            for _ in update.new_token_ids:
              self.itl.observe((now - last) / len(update.new_token_ids))
          last = now
        self.generation_tokens.inc(len(update.new_token_ids))
        if update.completion is not None:
          reason = update.completion.finish_reason
          self.e2e.observe(time.monotonic() - arrival)
        yield update
    except Exception:
      reason = "error"
      raise
    finally:
      await updates.aclose()
      self.finished.labels(finish_reason=reason).inc()
