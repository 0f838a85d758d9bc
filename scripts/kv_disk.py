"""The on-disk KV block store (`--kv_disk_path`): list its namespaces, or remove them.

A namespace is one engine configuration's blocks (model, KV dtype, block size, ...; see
jaxtier/kvcache/disk.py). The listing shows, per namespace, the model it was written for, the
file format, the number of blocks, their bytes and when a block was last written or read:

  python scripts/kv_disk.py --path=/data/kv
  python scripts/kv_disk.py --path=/data/kv --json
  python scripts/kv_disk.py --path=/data/kv --purge=<namespace>    # or --purge=all

Purging a namespace an engine is using makes that engine's next reads misses, nothing worse. A
missing directory or an unknown namespace is a one-line error and exit status 1.
"""

import json
import os
import sys

from absl import app, flags

from jaxtier.kvcache import disk

FLAGS = flags.FLAGS
flags.DEFINE_string("path", None, "the KV block store's directory (the engine's --kv_disk_path)",
                    required=True)
flags.DEFINE_string("purge", None, "remove this namespace, or every namespace with 'all'")
flags.DEFINE_bool("json", False, "print JSON instead of a table")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _fail(message: str) -> None:
  """Prints a one-line error to stderr and exits with status 1."""
  print(f"kv_disk: error: {message}", file=sys.stderr)
  sys.exit(1)


def human_bytes(n: int) -> str:
  """1536 -> '1.5 KiB': the table's sizes, read at a glance."""
  value = float(n)
  for unit in _UNITS:
    if value < 1024 or unit == _UNITS[-1]:
      return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
    value /= 1024
  raise AssertionError("unreachable")


def table(rows: list[dict]) -> str:
  """The namespaces as aligned columns, one line each."""
  head = ("namespace", "model", "format", "blocks", "bytes", "last use")
  lines = [head] + [(r["namespace"], str(r["info"].get("model", "-")), str(r["format"] or "-"),
                     str(r["blocks"]), human_bytes(r["bytes"]), r["last_use"] or "-")
                    for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  return "".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n"
                 for line in lines)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if not os.path.isdir(FLAGS.path):
    _fail(f"{FLAGS.path} is not a directory" if os.path.exists(FLAGS.path)
          else f"{FLAGS.path} does not exist")
  try:
    rows = disk.list_namespaces(FLAGS.path)
    if FLAGS.purge is None:
      if FLAGS.json:
        print(json.dumps(rows, indent=1))
      elif rows:
        print(table(rows), end="")
      else:
        print(f"no namespaces under {FLAGS.path}")
      return
    target = None if FLAGS.purge == "all" else FLAGS.purge
    removed = [r for r in rows if target is None or r["namespace"] == target]
    disk.purge(FLAGS.path, target)
  except (OSError, ValueError) as e:
    _fail(str(e))
  if FLAGS.json:
    print(json.dumps({"removed": removed}, indent=1))
    return
  for r in removed:
    print(f"removed {r['namespace']} ({r['info'].get('model', '-')}): {r['blocks']} blocks, "
          f"{human_bytes(r['bytes'])}")
  if not removed:
    print(f"no namespaces under {FLAGS.path}")


if __name__ == "__main__":
  app.run(main)
