"""The cost of structured outputs on the default model: grammar mask time and decode tokens/s.

Prints JSON: for each batch size, decode tokens/s of free requests against the same requests
constrained by a JSON schema (outputs checked to parse; they end sooner, so compare the step
times), and against requests under a regex that cannot end before max_tokens (every row runs
all its tokens, as the free ones do with ignore_eos: the per-token cost of the constraint), and
against a batch mixing the two (odd rows constrained by that regex, even rows free), the host
time spent computing grammar masks per constrained token and per step, and llguidance's
tokenizer build time; and the regex batch again with planning ahead switched off
("regex_full_not_ahead": what computing masks beside the device step buys). Each pass starts
with an empty prefix cache; the first pass of each kind compiles and is not timed; the timed
passes run in `--repeats` rounds of every kind and each kind reports its median pass (and every
pass's tokens/s).

  python scripts/bench_structured.py --batches=1,8 --new_tokens=48
"""

import dataclasses
import json
import time

from absl import app, flags

import jaxtier
from jaxtier.sampling import SamplingParams
from jaxtier.sampling import structured

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name or model directory")
flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
flags.DEFINE_integer("new_tokens", 48, "max_tokens per request")
flags.DEFINE_integer("repeats", 3, "timed passes of each kind, in rounds; the median is reported")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "city", "pets"], "additionalProperties": False}


class _Timed:
  """Wraps `GrammarMatcher.mask` to add up its calls and seconds."""

  def __init__(self):
    self.calls, self.seconds = 0, 0.0
    self._mask = structured.GrammarMatcher.mask
    timed = self

    def mask(matcher):
      start = time.perf_counter()
      out = timed._mask(matcher)
      timed.seconds += time.perf_counter() - start
      timed.calls += 1
      return out

    structured.GrammarMatcher.mask = mask


def _run(llm, conversations, params) -> tuple[float, int, list]:
  llm.reset_prefix_cache()
  start = time.perf_counter()
  outs = llm.chat(conversations, params)
  seconds = time.perf_counter() - start
  tokens = sum(len(o.outputs[0].token_ids) for o in outs)
  return seconds, tokens, outs


def _measure(llm, timer, conversations, params, ahead: bool) -> dict:
  """One timed pass: tokens/s, steps, steps planned ahead and grammar mask time. `ahead`: with
  the engine's planning ahead (else switched off for this pass, to measure what it buys)."""
  engine = llm.engine
  config = engine.config
  engine.config = dataclasses.replace(config, async_scheduling=ahead and config.async_scheduling)
  before = engine.stats()
  timer.calls, timer.seconds = 0, 0.0
  try:
    seconds, tokens, outs = _run(llm, conversations, params)
  finally:
    engine.config = config
  after = engine.stats()
  steps = after["steps"] - before["steps"]
  out = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "steps": steps,
         "ms_per_step": 1e3 * seconds / max(steps, 1),
         "steps_planned_ahead": after["steps_planned_ahead"] - before["steps_planned_ahead"],
         "mask_calls": timer.calls, "mask_ms_per_token": 1e3 * timer.seconds / max(timer.calls, 1),
         "mask_ms_per_step": 1e3 * timer.seconds / max(steps, 1)}
  if params[0].structured_outputs is not None and params[0].structured_outputs.json is not None:
    valid = 0
    for o in outs:
      try:
        json.loads(o.outputs[0].text)
        valid += 1
      except json.JSONDecodeError:
        pass  # cut by max_tokens
    out.update(parsed=valid, finished=sum(o.outputs[0].finish_reason == "stop" for o in outs))
  return out


def median_run(runs: list[dict]) -> dict:
  """The run of median tokens/s."""
  return dict(sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2])


def main(argv):
  del argv
  timer = _Timed()
  llm = jaxtier.LLM(FLAGS.model, max_model_len=512)
  start = time.perf_counter()
  structured.grammar_tokenizer(llm.tokenizer, llm.config.vocab_size)
  results = {"model": FLAGS.model, "vocab_size": llm.config.vocab_size,
             "grammar_tokenizer_seconds": time.perf_counter() - start, "batches": []}
  for b in map(int, FLAGS.batches):
    conversations = [[{"role": "user", "content": f"Describe person number {i} as JSON."}]
                     for i in range(b)]
    free = [SamplingParams(max_tokens=FLAGS.new_tokens, temperature=0.7, seed=i, ignore_eos=True)
            for i in range(b)]
    constrained = [SamplingParams(max_tokens=FLAGS.new_tokens, temperature=0.7, seed=i,
                                  structured_outputs={"json": SCHEMA}) for i in range(b)]
    full = [SamplingParams(max_tokens=FLAGS.new_tokens, temperature=0.7, seed=i, ignore_eos=True,
                           structured_outputs={"regex": "[a-zA-Z ,.]{4000}"}) for i in range(b)]
    # free and regex_full rows alternating in the same batch: what a constrained request costs
    # the free requests that share its steps
    mixed = [full[i] if i % 2 else free[i] for i in range(b)]
    row = {"batch": b}
    kinds = (("free", free), ("json_schema", constrained), ("regex_full", full),
             ("regex_full_not_ahead", full), ("mixed", mixed))
    for name, params in kinds:
      _run(llm, conversations, params)  # compiles
    runs = {name: [] for name, _ in kinds}
    for _ in range(FLAGS.repeats):  # rounds of every kind, so drifts of the machine hit all
      for name, params in kinds:
        runs[name].append(_measure(llm, timer, conversations, params,
                                   ahead=name != "regex_full_not_ahead"))
    for name, _ in kinds:
      row[name] = median_run(runs[name])
      row[name]["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs[name]]
      if name == "mixed":
        row[name]["constrained_rows"] = b // 2
      if name == "free":
        for key in ("mask_calls", "mask_ms_per_token", "mask_ms_per_step"):
          del row[name][key]
    for name in ("regex_full", "regex_full_not_ahead", "mixed"):
      row[f"{name}_tokens_per_s_ratio"] = row[name]["tokens_per_s"] / row["free"]["tokens_per_s"]
    results["batches"].append(row)
  print(json.dumps(results))


if __name__ == "__main__":
  app.run(main)
