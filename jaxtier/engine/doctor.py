"""Run doctor: matches a run's figures against a table of symptoms and their remedies.

The input is the engine's stats dict (what `LLM.stats()` returns, JSON-serializable). Each row of
the table is a small pure function of that dict; it returns a `Finding` (symptom, cause, remedy and
the figures that triggered it) or None. A row whose figures are missing, null, non-numeric or
non-finite does not apply, so stats from older or partial runs never raise.

| symptom                                 | remedy                                              |
| --------------------------------------- | --------------------------------------------------- |
| many small swaps                        | lower the watermark; relax the victim policy        |
| swap time dominates                     | kv_cache_dtype=int8, or a larger device pool        |
| host pool full                          | preemption_mode=recompute, or a bigger host pool    |
| prefetch not hidden                     | deeper prefetch_depth, or fewer offload_tail_layers |
| requests exceed KV capacity             | a larger device pool, or a lower max_tokens         |
| recompute preemptions with long prompts | preemption_mode=swap                                |
| prefixes evicted before reuse           | host_prefix_caching, or a larger device/host pool   |

The thresholds are the module constants below; every comparison is inclusive (a figure equal to its
threshold triggers the row). The per-step trace (JSONL, one object per step) is read by
`read_trace` and drawn by `plot_trace`; matplotlib is imported inside `plot_trace` only, and this
module imports no JAX.
"""

import dataclasses
import json
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence

# Symptoms, in the order the table (and the report) lists them.
SYMPTOM_SMALL_SWAPS = "many small swaps"
SYMPTOM_SWAP_TIME = "swap time dominates"
SYMPTOM_HOST_FULL = "host pool full"
SYMPTOM_PREFETCH = "prefetch not hidden"
SYMPTOM_KV_CAPACITY = "requests exceed KV capacity"
SYMPTOM_RECOMPUTE = "recompute preemptions with long prompts"
SYMPTOM_PREFIX_EVICTED = "prefixes evicted before reuse"

# Many small swaps. A run needs at least MIN_SWAPS swap-outs before the pattern means anything; it
# then applies when requests are swapped out at least SWAPS_PER_REQUEST times each on average (one
# swap-out per request is already a lot: every request paid a round trip over the link) and a
# swap-out moves at most SMALL_SWAP_BLOCKS blocks on average (64 tokens at the default block size of
# 16), so each preemption freed little and the fixed cost of a transfer dominates its bytes.
MIN_SWAPS = 8
SWAPS_PER_REQUEST = 1.0
SMALL_SWAP_BLOCKS = 4.0

# Swap time dominates: swaps took at least this share of the run's wall time (swap_seconds /
# run_seconds). A fifth of the run moving KV instead of computing is throughput the link takes away.
SWAP_TIME_FRACTION = 0.2

# Host pool full: any request aborted because its KV did not fit in the host pool, any recompute
# preemption in swap mode (in swap mode a victim is recomputed only when the host pool has no room
# for it), or a peak host use of at least this share of the host pool (no room for one more long
# request's KV).
HOST_FULL_FRACTION = 0.95

# Prefetch not hidden: a decode step took at least this many times the offload planner's
# compute-only step time. When the weight prefetch hides behind compute the two are close (the
# measured step adds sampling and scheduling, a few percent); 25% more is transfer time showing.
# Without a measured decode step, the planner's own prediction is compared instead.
PREFETCH_EXPOSED_RATIO = 1.25

# Requests exceed KV capacity: at least this many requests were aborted because prompt + max_tokens
# needs more KV than one request may hold. Any such abort is a request that never ran.
KV_CAPACITY_ABORTS = 1

# Recompute with long prompts: at least MIN_RECOMPUTES recompute preemptions making at least
# RECOMPUTE_SHARE of all preemptions, with prompts of at least LONG_PROMPT_TOKENS tokens on average.
# A recompute prefills the whole context again, compute that grows with the prompt, while a swap
# copies the same KV out and back at link speed without computing anything. 512 tokens is a rule of
# thumb for "long" (32 blocks of 16 tokens), not a measured crossover; the row says where swapping
# is worth trying, and the next run's numbers say whether it paid.
MIN_RECOMPUTES = 4
RECOMPUTE_SHARE = 0.5
LONG_PROMPT_TOKENS = 512.0

# Prefixes evicted before reuse: with prefix caching on, at least MIN_PREFIX_EVICTIONS cached
# blocks were evicted from the last tier that holds them (the device without the host tier, else
# the host tier), and they were at least PREFIX_EVICTIONS_PER_HIT of the blocks' worth of tokens
# the cache served (evictions x block_size over hit tokens): the cache throws away about as much
# as it serves, so repeated prefixes are being recomputed.
MIN_PREFIX_EVICTIONS = 64
PREFIX_EVICTIONS_PER_HIT = 0.5

# Width of the report's wrapped lines.
REPORT_WIDTH = 100


@dataclasses.dataclass(frozen=True)
class Finding:
  """One row of the table that applies to a run.

  Attributes:
    symptom: what the figures show (one of the SYMPTOM_* constants).
    cause: why that happens, in one or two sentences.
    remedy: what to change, naming the engine arguments.
    figures: the numbers that triggered the row, by name.
  """
  symptom: str
  cause: str
  remedy: str
  figures: dict


# --------------------------------------------------------------------------------------------------
# Reading figures


def number(stats: Mapping, key: str) -> float | None:
  """Returns stats[key] if it is a finite int or float (not a bool), else None."""
  value = stats.get(key)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return value if math.isfinite(value) else None


def _count(stats: Mapping, key: str, sub: str) -> float | None:
  """Returns the count stats[key][sub] (e.g. `preemptions`); 0 if the dict lacks `sub`."""
  table = stats.get(key)
  if not isinstance(table, Mapping):
    return None
  return number(table, sub) if sub in table else 0


def _total(stats: Mapping, key: str) -> float | None:
  """Returns the sum of the numeric values of the dict stats[key], or None if it is not a dict."""
  table = stats.get(key)
  if not isinstance(table, Mapping):
    return None
  return sum(v for v in (number(table, k) for k in table) if v is not None)


def _requests(stats: Mapping) -> float | None:
  """Returns the requests the run saw: finished plus aborted for any reason (None if unknown)."""
  finished = number(stats, "requests_finished")
  if finished is None:
    return None
  return finished + (_total(stats, "requests_aborted") or 0)


def _ratio(numerator: float, denominator: float) -> float:
  """Returns numerator / denominator rounded to 4 digits (inf when the denominator is 0)."""
  return round(numerator / denominator, 4) if denominator else math.inf


# --------------------------------------------------------------------------------------------------
# The table: one pure function per row


def small_swaps(stats: Mapping) -> Finding | None:
  """Many small swaps: frequent swap-outs (per request) that each move few blocks."""
  swaps = number(stats, "swap_out_count")
  blocks = number(stats, "swap_out_blocks")
  requests = _requests(stats)
  if swaps is None or blocks is None or not requests or swaps < MIN_SWAPS:
    return None
  per_request, per_swap = _ratio(swaps, requests), _ratio(blocks, swaps)
  if per_request < SWAPS_PER_REQUEST or per_swap > SMALL_SWAP_BLOCKS:
    return None
  figures = {"swap_out_count": swaps, "requests": requests, "swaps_per_request": per_request,
             "blocks_per_swap": per_swap}
  watermark = number(stats, "watermark_blocks")
  if watermark is not None:
    figures["watermark_blocks"] = watermark
  victims = ("relax the victim policy toward requests that hold more KV, so one preemption frees "
             "enough room (victim_policy=longest_waiting, the default, takes the oldest request, "
             "which usually holds the most)")
  if watermark == 0:
    cause = ("The watermark is already 0, so the device pool itself runs short a few blocks at a "
             "time, and each victim frees only a few blocks: requests go back and forth over the "
             "link for little room.")
    remedy = f"With no watermark to lower, {victims}, or give the device pool more blocks."
  else:
    cause = ("The watermark is too eager: the scheduler preempts to keep watermark_blocks free "
             "before the device pool is actually short, and each victim frees only a few blocks, "
             "so requests go back and forth over the link for little room.")
    remedy = f"Lower the watermark (watermark_blocks). If swaps stay small, {victims}."
  return Finding(symptom=SYMPTOM_SMALL_SWAPS, cause=cause, remedy=remedy, figures=figures)


def swap_time(stats: Mapping) -> Finding | None:
  """Swap time dominates: swaps take a large share of the run's wall time."""
  seconds, run = number(stats, "swap_seconds"), number(stats, "run_seconds")
  if seconds is None or not run or run <= 0:
    return None
  share = _ratio(seconds, run)
  if share < SWAP_TIME_FRACTION:
    return None
  figures = {"swap_seconds": seconds, "run_seconds": run, "swap_time_share": share}
  for key in ("swap_out_bytes", "swap_in_bytes"):
    if number(stats, key) is not None:
      figures[key] = number(stats, key)
  if stats.get("kv_cache_dtype") == "int8":
    dtype_remedy = "The cache is already int8, so give the device pool more room"
  else:
    dtype_remedy = ("Use an int8 KV cache (kv_cache_dtype=int8: half the bytes per swap of "
                    "bfloat16, a quarter of float32), or give the device pool more room")
  return Finding(
      symptom=SYMPTOM_SWAP_TIME,
      cause=("Moving KV between device and host takes a large share of the run: the link, not "
             "compute, sets the pace."),
      remedy=(f"{dtype_remedy} (num_device_blocks or kv_cache_memory_gb) so fewer requests are "
              "swapped at all."),
      figures=figures)


def host_full(stats: Mapping) -> Finding | None:
  """Host pool full: aborts or fallback recomputes for lack of host blocks, or a peak near full."""
  total, peak = number(stats, "host_blocks_total"), number(stats, "host_blocks_peak_used")
  aborts = _count(stats, "requests_aborted", "host_pool_full")
  fallbacks = (_count(stats, "preemptions", "recompute")
               if stats.get("preemption_mode") == "swap" else None)
  figures = {}
  if aborts:
    figures["host_pool_full_aborts"] = aborts
  if fallbacks:
    figures["recompute_preemptions_in_swap_mode"] = fallbacks
  if total and peak is not None and total > 0 and peak / total >= HOST_FULL_FRACTION:
    figures["host_peak_fraction"] = _ratio(peak, total)
  if not figures:
    return None
  if total is not None:
    figures["host_blocks_total"] = total
  if peak is not None:
    figures["host_blocks_peak_used"] = peak
  return Finding(
      symptom=SYMPTOM_HOST_FULL,
      cause=("The host pool has no room for more swapped KV: victims are recomputed or swapped "
             "requests aborted instead."),
      remedy=("Preempt by recompute (preemption_mode=recompute) when prompts are short, or give "
              "the host pool more blocks (num_host_blocks or swap_space_gb)."),
      figures=figures)


def prefetch_exposed(stats: Mapping) -> Finding | None:
  """Prefetch not hidden: with weight offload, a step takes well over its compute-only time."""
  offloaded = number(stats, "offload_tail_layers")
  compute = number(stats, "offload_compute_step_seconds")
  if not offloaded or offloaded <= 0 or not compute or compute <= 0:
    return None
  measured = number(stats, "decode_step_seconds_mean")
  predicted = number(stats, "offload_predicted_step_seconds")
  if measured is not None:
    step, key = measured, "decode_step_seconds_mean"
  else:
    step, key = predicted, "offload_predicted_step_seconds"
  if step is None or _ratio(step, compute) < PREFETCH_EXPOSED_RATIO:
    return None
  figures = {key: step, "offload_compute_step_seconds": compute,
             "step_over_compute": _ratio(step, compute), "offload_tail_layers": offloaded}
  for extra in ("prefetch_depth", "weight_transfer_bytes_per_step"):
    if number(stats, extra) is not None:
      figures[extra] = number(stats, extra)
  if measured is not None and predicted is not None:
    figures["offload_predicted_step_seconds"] = predicted
  return Finding(
      symptom=SYMPTOM_PREFETCH,
      cause=("The offloaded layers' weights arrive later than the compute needs them, so each step "
             "waits on the host link."),
      remedy=("Prefetch deeper (raise prefetch_depth) so more transfers are in flight, or offload "
              "fewer layers (lower offload_tail_layers): each resident layer is one transfer less "
              "per step."),
      figures=figures)


def kv_capacity(stats: Mapping) -> Finding | None:
  """Requests exceed KV capacity: requests aborted because their KV can never fit."""
  aborts = _count(stats, "requests_aborted", "exceeds_kv_capacity")
  if aborts is None or aborts < KV_CAPACITY_ABORTS:
    return None
  figures = {"exceeds_kv_capacity_aborts": aborts}
  for key in ("device_blocks_total", "block_size"):
    if number(stats, key) is not None:
      figures[key] = number(stats, key)
  return Finding(
      symptom=SYMPTOM_KV_CAPACITY,
      cause=("Some requests' prompt plus max_tokens needs more KV than one request may hold, so "
             "they were aborted without running."),
      remedy=("Give the device pool more blocks (num_device_blocks or kv_cache_memory_gb), or send "
              "those requests with a lower max_tokens."),
      figures=figures)


def recompute_long_prompts(stats: Mapping) -> Finding | None:
  """Recompute preemptions dominate while prompts are long (outside swap mode)."""
  if stats.get("preemption_mode") == "swap":
    return None  # there, recomputes are host-pool fallbacks: see host_full
  recomputes = _count(stats, "preemptions", "recompute")
  preemptions = _total(stats, "preemptions")
  prompt_tokens, requests = number(stats, "prompt_tokens"), _requests(stats)
  if not recomputes or recomputes < MIN_RECOMPUTES or prompt_tokens is None or not requests:
    return None
  share, prompt_mean = _ratio(recomputes, preemptions), _ratio(prompt_tokens, requests)
  if share < RECOMPUTE_SHARE or prompt_mean < LONG_PROMPT_TOKENS:
    return None
  return Finding(
      symptom=SYMPTOM_RECOMPUTE,
      cause=("Preempted requests drop their KV and prefill their long prompts again, compute "
             "that a copy over the link would save."),
      remedy=("Preempt by swapping (preemption_mode=swap) with a host pool (num_host_blocks or "
              "swap_space_gb) large enough for the victims' KV."),
      figures={"recompute_preemptions": recomputes, "recompute_share": share,
               "prompt_tokens_per_request": prompt_mean})


def prefix_evicted(stats: Mapping) -> Finding | None:
  """Prefixes evicted before reuse: the prefix cache's last tier evicts about as much as it serves."""
  if stats.get("prefix_caching") is not True:
    return None
  host_tier = stats.get("host_prefix_caching") is True
  key = "prefix_host_evictions" if host_tier else "prefix_device_evictions"
  evictions, block_size = number(stats, key), number(stats, "block_size")
  hits = (number(stats, "prefix_device_hit_tokens") or 0) + (number(stats, "prefix_host_hit_tokens")
                                                             or 0)
  if evictions is None or not block_size or evictions < MIN_PREFIX_EVICTIONS:
    return None
  per_hit = _ratio(evictions * block_size, hits)
  if per_hit < PREFIX_EVICTIONS_PER_HIT:
    return None
  figures = {key: evictions, "prefix_hit_tokens": hits, "evicted_tokens_per_hit_token": per_hit}
  for extra in ("prefix_device_hit_rate", "prefix_host_hit_rate", "device_blocks_total",
                "host_blocks_total"):
    if number(stats, extra) is not None:
      figures[extra] = number(stats, extra)
  if host_tier:
    cause = ("The host tier of the prefix cache is full: it drops cached prefixes (oldest "
             "first) about as fast as requests reuse them, and swapped-out requests take its "
             "blocks first.")
    remedy = ("Give the host pool more blocks (num_host_blocks or swap_space_gb), or the device "
              "pool more (num_device_blocks or kv_cache_memory_gb).")
  else:
    cause = ("The device pool cannot hold the prefixes requests come back to, and without the "
             "host tier an evicted prefix is recomputed.")
    remedy = ("Keep evicted prefixes in host memory (host_prefix_caching=True with a host pool: "
              "num_host_blocks or swap_space_gb), or give the device pool more blocks.")
  return Finding(symptom=SYMPTOM_PREFIX_EVICTED, cause=cause, remedy=remedy, figures=figures)


ROWS: tuple[Callable[[Mapping], Finding | None], ...] = (
    small_swaps, swap_time, host_full, prefetch_exposed, kv_capacity, recompute_long_prompts,
    prefix_evicted)


def diagnose(stats: dict) -> tuple[Finding, ...]:
  """Returns the findings of every row of the table that applies to `stats`, in table order.

  Args:
    stats: the engine's stats dict (`LLM.stats()`); missing keys make their rows not apply.

  Raises:
    TypeError: if `stats` is not a dict.
  """
  if not isinstance(stats, Mapping):
    raise TypeError(f"stats: expected a dict (the engine's stats), got {type(stats).__name__}")
  return tuple(f for f in (row(stats) for row in ROWS) if f is not None)


# --------------------------------------------------------------------------------------------------
# Report


def _format_bytes(value: float) -> str:
  """Returns a byte count in binary units (`1.50 MiB`)."""
  if abs(value) < 1024:
    return f"{value:.0f} B"
  for unit in ("KiB", "MiB", "GiB"):
    value /= 1024
    if abs(value) < 1024:
      break
  return f"{value:.2f} {unit}"


def format_figure(name: str, value) -> str:
  """Returns `name=value`, with bytes in binary units and seconds in s or ms."""
  if value is None:
    shown = "n/a"
  elif name.endswith("_bytes") or name.endswith("_bytes_per_step"):
    shown = _format_bytes(value)
  elif name.endswith("_seconds") or name.endswith("_seconds_mean"):
    shown = f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
  elif isinstance(value, float) and not value.is_integer():
    shown = f"{value:.4g}"
  else:
    shown = str(int(value)) if isinstance(value, float) and math.isfinite(value) else str(value)
  return f"{name}={shown}"


def watch_numbers(stats: Mapping) -> dict:
  """Returns the three numbers to watch on every run: swap count, swap bytes and swap time.

  Count and bytes add swap-outs and swap-ins; a number is None when its figures are missing.
  """
  def both(out_key, in_key):
    out, into = number(stats, out_key), number(stats, in_key)
    return None if out is None and into is None else (out or 0) + (into or 0)
  return {"swap_count": both("swap_out_count", "swap_in_count"),
          "swap_bytes": both("swap_out_bytes", "swap_in_bytes"),
          "swap_seconds": number(stats, "swap_seconds")}


def _wrap(label: str, text: str) -> str:
  """Returns `text` wrapped to REPORT_WIDTH columns under an indented `label:`."""
  head = f"   {label + ':':<9}"
  return textwrap.fill(text, width=REPORT_WIDTH, initial_indent=head,
                       subsequent_indent=" " * len(head), break_on_hyphens=False).replace("\0", " ")


def report(findings: Sequence[Finding], stats: Mapping | None = None) -> str:
  """Returns the plain-text report: each finding with its figures, then the numbers to watch.

  Args:
    findings: what `diagnose` returned.
    stats: the same stats, for the numbers to watch (swap count, bytes, time); they print as n/a
      without it.
  """
  if findings:
    lines = [f"{len(findings)} symptom{'s' if len(findings) > 1 else ''} found:"]
    for i, finding in enumerate(findings, 1):
      # A figure never breaks across lines: its own spaces are held as NULs while wrapping.
      figures = ", ".join(format_figure(k, v).replace(" ", "\0")
                          for k, v in finding.figures.items())
      lines += ["", f"{i}. {finding.symptom}"]
      lines += [_wrap(label, text) for label, text in (("figures", figures),
                                                        ("cause", finding.cause),
                                                        ("remedy", finding.remedy))]
  else:
    lines = ["no symptoms found"]
  watch = watch_numbers(stats or {})
  lines += ["", "numbers to watch: " + ", ".join(format_figure(k, v) for k, v in watch.items())]
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Files


def load_stats(path: str) -> dict:
  """Reads a stats JSON file (one object).

  Raises:
    FileNotFoundError: if `path` does not exist.
    ValueError: if the file is not valid JSON or not an object.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"stats file {path} does not exist")
  with open(path) as f:
    text = f.read()
  try:
    stats = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
  if not isinstance(stats, dict):
    raise ValueError(f"{path}: expected a JSON object (the engine's stats), got "
                     f"{type(stats).__name__}")
  return stats


def read_trace(path: str) -> list[dict]:
  """Reads a per-step trace: JSONL, one object with at least a numeric `step` per line.

  Blank lines are skipped. Raises FileNotFoundError if `path` does not exist, ValueError naming the
  first bad line's number if a line is not valid JSON, not an object, or has no numeric `step`.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"trace file {path} does not exist")
  rows = []
  with open(path) as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {line_number}: not valid JSON ({e.msg})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path} line {line_number}: expected a JSON object, got "
                         f"{type(row).__name__}")
      if number(row, "step") is None:
        raise ValueError(f"{path} line {line_number}: expected a numeric 'step'")
      rows.append(row)
  return rows


def _series(rows: Sequence[Mapping], key: str) -> list[float] | None:
  """Returns rows' values of `key` (missing ones as 0), or None if no row has it."""
  if not any(number(row, key) is not None for row in rows):
    return None
  return [number(row, key) or 0 for row in rows]


def plot_trace(rows: Sequence[Mapping], path_png: str, title: str | None = None, *,
               device_blocks_total: float | None = None,
               host_blocks_total: float | None = None) -> str:
  """Draws a trace as one PNG of three stacked panels over the step.

  Panels: KV blocks in use per tier (device, host; each pool's total as a dashed line when given),
  blocks swapped per step (swap-outs as bars above zero, swap-ins below), and requests running,
  waiting and swapped. Keys absent from every row are left out of their panel.

  Args:
    rows: trace rows (see `read_trace`), each with a numeric `step`.
    path_png: where to write the PNG.
    title: figure title (default: "jaxtier run trace").
    device_blocks_total, host_blocks_total: pool sizes, drawn as horizontal lines.

  Returns:
    path_png.

  Raises:
    ValueError: if `rows` is empty or a row has no numeric `step`.
  """
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.ticker import FuncFormatter, MaxNLocator
  # pylint: enable=import-outside-toplevel

  if not rows:
    raise ValueError("trace is empty: expected at least one step")
  for i, row in enumerate(rows):
    if not isinstance(row, Mapping) or number(row, "step") is None:
      raise ValueError(f"trace row {i}: expected an object with a numeric 'step'")
  steps = [row["step"] for row in rows]

  fig = Figure(figsize=(10, 9), layout="constrained")
  FigureCanvasAgg(fig)
  kv_ax, swap_ax, req_ax = fig.subplots(3, 1, sharex=True)
  fig.suptitle(title or "jaxtier run trace", fontsize=14)

  tiers = (("device_blocks_used", "device", "tab:blue", device_blocks_total),
           ("host_blocks_used", "host", "tab:orange", host_blocks_total))
  for key, label, color, total in tiers:
    values = _series(rows, key)
    if values is not None:
      kv_ax.step(steps, values, where="post", color=color, label=f"{label} blocks in use")
    if total is not None:
      kv_ax.axhline(total, color=color, linestyle="--", linewidth=1,
                    label=f"{label} pool ({total:g} blocks)")
  kv_ax.set_ylim(bottom=0)
  kv_ax.set_ylabel("KV blocks")
  kv_ax.set_title("KV blocks in use per tier", loc="left", fontsize=11)

  gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
  width = 0.8 * min(gaps, default=1)
  outs, ins = _series(rows, "swap_out_blocks"), _series(rows, "swap_in_blocks")
  if outs is not None:
    swap_ax.bar(steps, outs, width=width, color="tab:red", label="swapped out (device to host)")
  if ins is not None:
    swap_ax.bar(steps, [-v for v in ins], width=width, color="tab:green",
                label="swapped in (host to device)")
  swap_ax.axhline(0, color="black", linewidth=0.6)
  swap_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{abs(v):g}"))
  swap_ax.set_ylabel("blocks per step\n(out above 0, in below)")
  swap_ax.set_title("KV blocks swapped per step", loc="left", fontsize=11)

  for key, color in (("running", "tab:blue"), ("waiting", "tab:gray"), ("swapped", "tab:purple")):
    values = _series(rows, key)
    if values is not None:
      req_ax.step(steps, values, where="post", color=color, label=key)
  req_ax.set_ylim(bottom=0)
  req_ax.set_ylabel("requests")
  req_ax.set_xlabel("step")
  req_ax.set_title("requests by state", loc="left", fontsize=11)
  req_ax.yaxis.set_major_locator(MaxNLocator(integer=True))

  for ax in (kv_ax, swap_ax, req_ax):
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
  fig.savefig(path_png, format="png", dpi=100)
  return path_png
