"""GRPO on a tiny randomly initialized model, in one process: the engine generates, optax trains.

Each step samples a group of completions per prompt with `jaxtier.LLM` (their tokens' processed
log-probabilities, the distribution actually sampled, come back as arrays), scores them with a
reward that needs no data (how many of a completion's tokens are among a chosen few), computes
the GRPO loss
(group-normalized advantages, the clipped importance ratio against the sampled log-probabilities)
through the model, takes an optax step and hands the new weights to the engine with
`update_weights` (no recompiling). It prints the mean reward of each step.

    python examples/grpo_tiny.py --steps=30
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

import jaxtier
from jaxtier import checkpoint
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import Transformer

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "GRPO steps")
flags.DEFINE_integer("group", 8, "completions per prompt (GRPO's group)")
flags.DEFINE_integer("max_tokens", 8, "tokens per completion")
flags.DEFINE_float("learning_rate", 1e-2, "Adam's learning rate")
flags.DEFINE_integer("seed", 0, "the model's and the sampling's seed")
flags.DEFINE_string("tokenizer", "tests/fixtures/tiny_llama", "a directory with the tokenizer "
                    "(its config gives the model's shape; the weights are random)")

TARGETS = 30  # the reward counts the tokens with ids below this: 10% of the tiny vocabulary
PROMPTS = ([5, 6, 7], [9, 10, 11, 12])
CLIP = 0.2


def reward(token_ids) -> float:
  """The share of a completion's tokens whose ids are below TARGETS."""
  return float(np.mean(np.asarray(token_ids) < TARGETS)) if len(token_ids) else 0.0


def advantages(rewards: np.ndarray, group: np.ndarray) -> np.ndarray:
  """GRPO's advantages: each reward less its group's mean, over the group's deviation."""
  out = np.zeros_like(rewards)
  for g in np.unique(group):
    r = rewards[group == g]
    out[group == g] = (r - r.mean()) / (r.std() + 1e-4)
  return out


def token_logprobs(model: Transformer, tokens_bt, positions_bt) -> jax.Array:
  """log p(token t | tokens before it) for t >= 1 [b, t - 1], from one full forward pass."""
  c = model.config
  b, t = tokens_bt.shape
  cache = ContiguousKVCache.create(c.num_layers, b, t, c.num_kv_heads, c.head_dim)
  logits_btv, _ = model(tokens_bt, positions_bt, cache)
  logp_btv = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32))
  return jnp.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
  """One GRPO step on `batch` (`jaxtier.rollout_arrays` plus "advantages"); returns the loss."""
  def loss_fn(model):
    new_bt = token_logprobs(model, batch["tokens"], batch["positions"])
    old_bt = batch["processed_logprobs"][:, 1:]
    mask_bt = batch["completion_mask"][:, 1:]
    ratio_bt = jnp.exp(new_bt - old_bt)
    adv_b1 = batch["advantages"][:, None]
    objective_bt = jnp.minimum(ratio_bt * adv_b1,
                               jnp.clip(ratio_bt, 1 - CLIP, 1 + CLIP) * adv_b1)
    return -jnp.sum(objective_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def main(argv):
  del argv
  config = checkpoint.hf.read_config(FLAGS.tokenizer)
  tokenizer = checkpoint.load_model(FLAGS.tokenizer)[1]
  model = Transformer(config, rngs=nnx.Rngs(FLAGS.seed))
  optimizer = nnx.Optimizer(model, optax.adam(FLAGS.learning_rate), wrt=nnx.Param)
  llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=32,
                    max_num_seqs=len(PROMPTS) * FLAGS.group, seed=FLAGS.seed)
  prompts = [list(p) for p in PROMPTS for _ in range(FLAGS.group)]
  start = time.perf_counter()
  for step in range(FLAGS.steps):
    params = [jaxtier.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=1.0, logprobs=0,
                                     ignore_eos=True, seed=FLAGS.seed * 100_000 + step * 100 + i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    batch = jaxtier.rollout_arrays(outputs)
    rewards = np.asarray([reward(o.token_ids) for o in outputs], np.float32)
    batch["advantages"] = advantages(rewards, batch["group"])
    loss = train_step(model, optimizer, {k: jnp.asarray(v) for k, v in batch.items()})
    llm.update_weights(nnx.state(model, nnx.Param))
    print(f"step {step:2d}  mean reward {rewards.mean():.3f}  loss {float(loss):+.4f}  "
          f"weights version {llm.weights_version}", flush=True)
  print(f"{FLAGS.steps} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  app.run(main)
