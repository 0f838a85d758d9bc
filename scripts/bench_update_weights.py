"""How long `LLM.update_weights` takes on the default model's float32 weights: JSON out.

A trainer holds the model (`jaxtier.checkpoint.load_model`, float32) and hands its
`nnx.state(model, nnx.Param)` to an engine built around it. Cases, each the median of `--repeats`
updates after one untimed:
- `in_place`: the portable layout (what a GPU or TPU runs: one scanned stack), the weights
  already on the device where the engine keeps them: used as they are, nothing copied;
- `moved`: the same layout from numpy arrays in host memory: every tensor placed;
- `cpu_layout`: the CPU's default layout (unrolled layers, q/k/v and gate/up fused and packed in
  column panels for the C++ kernels): every projection fused and packed again.
Each case also checks that the update compiled nothing (the engine's compile seconds unchanged).

  python scripts/bench_update_weights.py --repeats=5
"""

import statistics

from absl import app, flags

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name or path of the model")
flags.DEFINE_integer("repeats", 5, "timed updates per case")
flags.DEFINE_string("out", None, "also write the JSON here")


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel  (JAX starts here)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jaxtier  # pylint: disable=import-outside-toplevel
  from jaxtier import checkpoint  # pylint: disable=import-outside-toplevel

  model, tokenizer = checkpoint.load_model(FLAGS.model)
  on_device = nnx.state(model, nnx.Param)
  on_host = jax.tree.map(np.asarray, on_device)
  report = {"model": FLAGS.model, "platform": jax.default_backend(),
            "weight_bytes": sum(a.nbytes for a in jax.tree.leaves(on_device)), "cases": {}}
  cases = {"in_place": (dict(kernels="portable"), on_device),
           "moved": (dict(kernels="portable"), on_host),
           "cpu_layout": ({}, on_device)}
  for name, (engine_args, params) in cases.items():
    llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=256, max_num_seqs=4,
                      **engine_args)
    llm.generate([[1, 2, 3]], jaxtier.SamplingParams(max_tokens=2, temperature=0))
    compiled = llm.engine.runner.compile_seconds

    def update(llm=llm, params=params):
      llm.update_weights(params)
      jax.block_until_ready(jax.tree.leaves(llm.state))

    seconds = benchlib.timed_calls(update, FLAGS.repeats)
    report["cases"][name] = {
        "median_ms": round(1000 * statistics.median(seconds), 1),
        "all_ms": [round(1000 * s, 1) for s in seconds],
        "layer_execution": llm.layer_execution,
        "compiled_nothing": llm.engine.runner.compile_seconds == compiled}
    benchlib.release(llm)
  benchlib.print_report(report, FLAGS.out, indent=1)


if __name__ == "__main__":
  app.run(main)
