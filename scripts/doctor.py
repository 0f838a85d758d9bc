"""Run doctor: reads a run's stats (and optionally its per-step trace), prints what to change.

Matches the stats (what `LLM.stats()` returns, saved as JSON) against the symptom -> remedy table of
jaxtier/engine/doctor.py and prints every row that applies with the figures that triggered it, then
the three numbers to watch on every run: swap count, swap bytes and swap time.

  python scripts/doctor.py --stats=run_stats.json
  python scripts/doctor.py --stats=run_stats.json --trace=trace.jsonl --plot=trace.png

--plot draws the trace (KV blocks per tier, blocks swapped per step, requests by state) and needs
--trace. A missing or invalid file is a one-line error and exit status 1.
"""

import importlib.util
import sys

from absl import app, flags

from jaxtier.engine import doctor

FLAGS = flags.FLAGS
flags.DEFINE_string("stats", None, "the run's stats, a JSON object (LLM.stats())", required=True)
flags.DEFINE_string("trace", None, "the run's per-step trace, JSONL (optional)")
flags.DEFINE_string("plot", None, "write a PNG of the trace here (needs --trace)")
flags.DEFINE_string("title", None, "title of the plot (default: the trace's file name)")


def _fail(message: str) -> None:
  """Prints a one-line error to stderr and exits with status 1."""
  print(f"doctor: error: {message}", file=sys.stderr)
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.plot and not FLAGS.trace:
    _fail("--plot needs --trace")
  if FLAGS.plot and importlib.util.find_spec("matplotlib") is None:
    _fail('--plot needs matplotlib, the [plot] extra: pip install -e ".[plot]" (or pip install '
          '"jaxtier[plot]")')
  try:
    stats = doctor.load_stats(FLAGS.stats)
    rows = doctor.read_trace(FLAGS.trace) if FLAGS.trace else None
  except (OSError, ValueError) as e:
    _fail(str(e))
  print(doctor.report(doctor.diagnose(stats), stats), end="")
  if rows is not None:
    print(f"trace: {len(rows)} steps in {FLAGS.trace}")
  if FLAGS.plot:
    if not rows:
      _fail(f"{FLAGS.trace} has no steps to plot")
    try:
      doctor.plot_trace(rows, FLAGS.plot, FLAGS.title or f"jaxtier run trace: {FLAGS.trace}",
                        device_blocks_total=doctor.number(stats, "device_blocks_total"),
                        host_blocks_total=doctor.number(stats, "host_blocks_total"))
    except OSError as e:
      _fail(f"cannot write {FLAGS.plot}: {e.strerror or e}")
    print(f"plot: {FLAGS.plot}")


if __name__ == "__main__":
  app.run(main)
