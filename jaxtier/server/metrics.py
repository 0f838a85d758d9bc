"""Prometheus metrics of one server, in a registry the app owns (names prefixed `jaxtier_`).

Per-request counters and latency histograms are observed by the HTTP layer as updates stream
through `track`; queue gauges, model steps and weight bytes streamed from the host are read from
the engine when `/metrics` is scraped.
"""

import time
from typing import AsyncIterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxtier.generate import StepUpdate
from jaxtier.server.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
  """Reads the engine's queue and step counts at scrape time."""

  def __init__(self, engine: AsyncEngine, weight_bytes_per_step: int):
    self._engine, self._weight_bytes_per_step = engine, weight_bytes_per_step

  def collect(self):
    stats = self._engine.stats()
    yield GaugeMetricFamily("jaxtier_requests_running", "requests in the running batch",
                            value=stats.running)
    yield GaugeMetricFamily("jaxtier_requests_waiting", "requests queued for a batch",
                            value=stats.waiting)
    yield CounterMetricFamily("jaxtier_model_steps", "model steps run (prefills included)",
                              value=stats.steps)
    yield CounterMetricFamily(
        "jaxtier_weight_transfer_bytes", "weight bytes streamed from host memory to the device "
        "(host-resident weight bytes per step times model steps)",
        value=stats.steps * self._weight_bytes_per_step)


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
    for key, name in (("device_weight_bytes", "jaxtier_device_weight_bytes"),
                      ("host_weight_bytes", "jaxtier_host_weight_bytes"),
                      ("device_kv_bytes", "jaxtier_device_kv_cache_bytes")):
      Gauge(name, f"memory_report()['{key}']", registry=self.registry).set(report[key])
    self.registry.register(_EngineCollector(engine, report["weight_transfer_bytes_per_step"]))

  def render(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)

  async def track(self, updates: AsyncIterator[StepUpdate], prompt_len: int, arrival: float
                  ) -> AsyncIterator[StepUpdate]:
    """Passes a request's updates through, counting tokens, latencies and how it ended.

    A stream closed before its last update counts as finished with reason "abort".
    """
    self.prompt_tokens.inc(prompt_len)
    first, reason = True, "abort"
    try:
      async for update in updates:
        if first and update.new_token_ids:
          self.ttft.observe(time.monotonic() - arrival)
          first = False
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
