"""Scheduler overhead per step with N running requests; prints JSON (median microseconds).

    python scripts/bench_scheduler.py --running=256,1024

A step is what the engine pays per model step: applying the previous step's StepFinished and
planning the next one (`scheduler.step`). Requests decode in steady state, a new KV block every
`block_size` steps, with no preemption; --finish_every=k also ends one request every k steps and
admits a new one, so admission and freeing are measured too. Target: <= 1000 us at 256 running.
"""

import json
import statistics
import time

from absl import app, flags

from jaxtier import scheduler

FLAGS = flags.FLAGS
flags.DEFINE_list("running", ["256", "1024"], "Running request counts to measure.")
flags.DEFINE_integer("steps", 300, "Measured steps per count, after warm-up.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens of each request.")
flags.DEFINE_integer("block_size", 16, "Tokens per block.")
flags.DEFINE_integer("finish_every", 0, "End one request and admit one every k steps (0: never).")

_TARGET_US_AT_256 = 1000.0


def _warm_state(num_running: int) -> tuple[scheduler.SchedulerState, int]:
  """Returns a state with `num_running` requests decoding, the plan in flight, and the next id."""
  max_tokens = 4 * FLAGS.steps + 64
  tokens = FLAGS.prompt_len + max_tokens
  config = scheduler.SchedulerConfig(
      num_device_blocks=2 * num_running * scheduler.blocks_for(tokens, FLAGS.block_size),
      num_host_blocks=num_running * 8, block_size=FLAGS.block_size, max_num_seqs=num_running,
      max_num_batched_tokens=max(num_running, 8192), watermark=0.05, preemption_mode="swap",
      victim_policy="longest_waiting", enable_prefix_caching=False, host_prefix_caching=True)
  arrivals = [scheduler.Arrive(scheduler.Request(i, FLAGS.prompt_len, max_tokens))
              for i in range(num_running)]
  state, plan = scheduler.step(scheduler.initial_state(config), arrivals)
  while len(plan.decode) < num_running:
    state, plan = scheduler.step(state, [scheduler.StepFinished()])
  return state, num_running


def _measure(num_running: int) -> dict:
  state, next_id = _warm_state(num_running)
  step_ns, event_ns, schedule_ns = [], [], []
  for i in range(FLAGS.steps):
    events = [scheduler.StepFinished()]
    if FLAGS.finish_every and i % FLAGS.finish_every == 0:
      stopping = state.in_flight.decode.request_ids[0]
      events = [scheduler.StepFinished(((stopping, "stop"),)),
                scheduler.Arrive(scheduler.Request(next_id, FLAGS.prompt_len, 4 * FLAGS.steps))]
      next_id += 1
    start = time.perf_counter_ns()
    for event in events:
      state = scheduler.apply_event(state, event)
    middle = time.perf_counter_ns()
    state, plan = scheduler.schedule(state)
    end = time.perf_counter_ns()
    assert not plan.swap_out and len(plan.decode) + len(plan.prefill) >= num_running - 1
    step_ns.append(end - start)
    event_ns.append(middle - start)
    schedule_ns.append(end - middle)
  return {
      "median_us": statistics.median(step_ns) / 1e3,
      "p90_us": statistics.quantiles(step_ns, n=10)[-1] / 1e3,
      "events_median_us": statistics.median(event_ns) / 1e3,
      "schedule_median_us": statistics.median(schedule_ns) / 1e3,
      "device_blocks": state.config.num_device_blocks, "steps": FLAGS.steps,
  }


def main(argv):
  del argv
  results = {f"running_{n}": _measure(int(n)) for n in FLAGS.running}
  report = {"results": results, "target_us_at_256": _TARGET_US_AT_256}
  if "running_256" in results:
    report["meets_target"] = results["running_256"]["median_us"] <= _TARGET_US_AT_256
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
