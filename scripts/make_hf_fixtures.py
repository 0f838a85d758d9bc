"""Regenerates the Hugging Face reference fixtures under tests/fixtures (needs `pip install -e .[ref]`).

Writes:
  tests/fixtures/tiny_llama/   a random Llama checkpoint (llama3 rope scaling, untied embeddings, several
                               safetensors shards with an index), tokenizer, and hf_logits.npz
  tests/fixtures/tiny_qwen2/   a random Qwen2 checkpoint (q/k/v biases, tied embeddings), same files
  tests/fixtures/tiny_qwen3/, tiny_mistral/, tiny_phi3/, tiny_gemma2/, tiny_gemma3/,
  tiny_mixtral/, tiny_qwen3_moe/  random checkpoints of the other families (Qwen3: per-head q/k
                               norms, head_dim apart from hidden / heads, tied embeddings; Mistral: a 16-token
                               sliding window; Phi-3: fused qkv_proj and gate_up_proj; Gemma 2:
                               norms around both blocks, GeGLU, a sliding layer then a full one,
                               soft-capped scores and logits; Gemma 3 text: q/k norms, rotary
                               bases per layer type, the full layer's scaled; Mixtral and
                               Qwen3-MoE: 4 experts of width 32, 2 per token, Qwen3-MoE's weights not
                               renormalized) and HF's logits over two 48-token sequences
                               (`--only_families` writes these seven alone)
  tests/fixtures/tiny_llama_chat/  a random Llama checkpoint and tokenizer as `save_pretrained` of
                               this transformers writes them (the chat template in
                               chat_template.jinja), and hf_chat.json: chat-templated prompts, their
                               renderings and ids, and HF's greedy generation from them
                               (`--only_chat_template` writes this one alone)
  tests/fixtures/smollm2_hf.json  for the default model: prompt token ids, HF's top-k last-position
                               logits, 24-token greedy continuations, chat template renderings and
                               tokenizations, computed by transformers from the same GGUF file;
                               and under "repetition_penalty", `generate(repetition_penalty=1.3,
                               do_sample=False)` continuations (`--only_repetition_penalty` adds
                               this key alone, leaving the rest of the file as it is)

The test suite reads only these files; it never imports torch or transformers.
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from absl import app, flags
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

from jaxtier.checkpoint import registry

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"),
                    "fixture directory")
flags.DEFINE_integer("top_k", 20, "how many last-position logits to keep per prompt")
flags.DEFINE_integer("continuation", 24, "greedy continuation length")
flags.DEFINE_bool("only_chat_template", False, "write tests/fixtures/tiny_llama_chat alone")
flags.DEFINE_bool("only_families", False,
                  "write the fixtures of the families after Llama and Qwen2 alone")
flags.DEFINE_bool("only_repetition_penalty", False,
                  "add the repetition-penalty continuations to smollm2_hf.json alone")
REPETITION_PENALTY = 1.3
PENALTY_CONTINUATION = 32

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOKENIZER_TEXT = ("The quick brown fox jumps over the lazy dog. Rotary embeddings rotate pairs of "
                  "features; grouped-query attention shares keys and values across heads. 0123456789 "
                  "Hello, world! Caches page blocks between device and host memory.") * 4
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus sailed",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fact about octopuses."}],
]
TOKENIZE_TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "Numbers: 12345 and 3.14159",
                  "Unicode: café, naïve, 日本語, emoji 🙂", "<|im_start|>user\nHi<|im_end|>",
                  "snake_case_identifier = compute(x, y=2)"]


def tiny_tokenizer(directory: str) -> None:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TOKENIZER_TEXT], trainer)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f, indent=1)


def tiny_model(directory: str, config: transformers.PretrainedConfig, cls, shard: str | None,
               lengths: tuple[int, int] = (7, 13)):
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  torch.manual_seed(0)
  model = cls(config).eval()
  with torch.no_grad():  # random norms and biases, so a loader that drops them fails the test
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("bias"):
        p.copy_(1.0 + 0.5 * torch.randn_like(p) if name.endswith("weight") else 0.5 * torch.randn_like(p))
  kwargs = {"max_shard_size": shard} if shard else {}
  model.save_pretrained(directory, safe_serialization=True, **kwargs)
  tiny_tokenizer(directory)
  rng = np.random.default_rng(0)
  inputs = {"ids_a": rng.integers(0, config.vocab_size, lengths[0]),
            "ids_b": rng.integers(0, config.vocab_size, lengths[1])}
  out = {}
  with torch.no_grad():
    for name, ids in inputs.items():
      out[name] = ids.astype(np.int32)
      out[name.replace("ids", "logits")] = model(torch.tensor(ids[None])).logits[0].numpy()
  np.savez(os.path.join(directory, "hf_logits.npz"), **out)


def hf_smollm(gguf_path: str):
  directory, name = os.path.split(gguf_path)
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                            dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  # The GGUF records pre-tokenizer "smollm"; SmolLM2's own tokenizer.json splits digits one by one
  # before the byte-level step, which transformers' GGUF converter does not reproduce. Restore it.
  tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  return model, tokenizer


def greedy(model, ids: list[int], steps: int) -> list[int]:
  out, past, inputs = [], None, torch.tensor([ids])
  with torch.no_grad():
    for _ in range(steps):
      result = model(inputs, past_key_values=past, use_cache=True)
      past = result.past_key_values
      token = int(result.logits[0, -1].argmax())
      out.append(token)
      inputs = torch.tensor([[token]])
  return out


def smollm_fixture(path: str) -> None:
  manifest = registry.find_manifest("smollm2-135m-instruct")
  model, tokenizer = hf_smollm(registry.fetch(manifest))
  cases = [{"kind": "raw", "prompt": p, "ids": tokenizer(p).input_ids} for p in RAW_PROMPTS]
  for conv in CONVERSATIONS:
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    cases.append({"kind": "chat", "messages": conv, "text": text,
                  "ids": tokenizer(text, add_special_tokens=False).input_ids})
  for case in cases:
    with torch.no_grad():
      logits = model(torch.tensor([case["ids"]])).logits[0, -1].numpy()
    top = np.argsort(-logits)[:FLAGS.top_k]
    case["top_ids"] = top.tolist()
    case["top_logits"] = logits[top].tolist()
    case["greedy"] = greedy(model, case["ids"], FLAGS.continuation)
  tokenized = [{"text": t, "ids": tokenizer(t).input_ids} for t in TOKENIZE_TEXTS]
  with open(path, "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
               "model": manifest.name, "sha256": manifest.sha256, "cases": cases,
               "tokenized": tokenized,
               "repetition_penalty": repetition_penalty_cases(model, tokenizer)}, f, indent=1)


def repetition_penalty_cases(model, tokenizer) -> dict:
  """Hugging Face's `generate(repetition_penalty=REPETITION_PENALTY, do_sample=False)` on three
  raw prompts, PENALTY_CONTINUATION new tokens each (EOS does not stop it)."""
  config = transformers.GenerationConfig(do_sample=False, repetition_penalty=REPETITION_PENALTY,
                                         max_new_tokens=PENALTY_CONTINUATION, eos_token_id=None,
                                         pad_token_id=0)
  cases = []
  for prompt in RAW_PROMPTS[:3]:
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                           generation_config=config)
    cases.append({"prompt": prompt, "ids": ids, "greedy": out[0, len(ids):].tolist()})
  return {"penalty": REPETITION_PENALTY, "cases": cases}


def add_repetition_penalty(path: str) -> None:
  """Adds (or replaces) the "repetition_penalty" key of the fixture at `path`."""
  model, tokenizer = hf_smollm(registry.fetch(registry.find_manifest("smollm2-135m-instruct")))
  with open(path) as f:
    fixture = json.load(f)
  fixture["repetition_penalty"] = repetition_penalty_cases(model, tokenizer)
  with open(path, "w") as f:
    json.dump(fixture, f, indent=1)


# A template that exercises what the loader must get right: trim_blocks / lstrip_blocks
# whitespace, bos/eos tokens, filters and a system message handled apart.
CHAT_TEMPLATE_JINJA = """{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'system' %}
[SYS] {{ m['content'] | trim }}
  {% else %}
<|{{ m['role'] }}|>
{{ m['content'] }}{{ eos_token }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world! The quick brown fox."}],
    [{"role": "system", "content": "  Rotary embeddings rotate pairs.  "},
     {"role": "user", "content": "Caches page blocks between device and host memory."}],
]


def tiny_llama_chat(directory: str, new_tokens: int = 12) -> None:
  """A random Llama (tiny_llama's sizes) and its tokenizer with a chat template, both saved by
  `save_pretrained`, and HF's greedy generation from each chat-templated conversation."""
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  scratch = os.path.join(directory, "_tokenizer")
  os.makedirs(scratch)
  tiny_tokenizer(scratch)
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_file=os.path.join(scratch, "tokenizer.json"), bos_token="<s>", eos_token="</s>",
      chat_template=CHAT_TEMPLATE_JINJA)
  shutil.rmtree(scratch)
  tokenizer.save_pretrained(directory)
  if not os.path.isfile(os.path.join(directory, "chat_template.jinja")):
    sys.exit(f"transformers {transformers.__version__} did not write chat_template.jinja")
  config = transformers.LlamaConfig(
      vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(directory, safe_serialization=True)
  cases = []
  for conv in CHAT_CONVERSATIONS:
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                           output_scores=True, return_dict_in_generate=True)
    top2 = [torch.topk(s[0], 2).values for s in out.scores]
    cases.append({"messages": conv, "text": text, "ids": ids,
                  "greedy": out.sequences[0, len(ids):].tolist(),
                  "min_top2_margin": min(float(v[0] - v[1]) for v in top2)})
  with open(os.path.join(directory, "hf_chat.json"), "w") as f:
    json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
               "max_new_tokens": new_tokens, "cases": cases}, f, indent=1)


def family_fixtures(out: str) -> None:
  """tiny_qwen3, tiny_mistral, tiny_phi3, tiny_gemma2, tiny_gemma3, tiny_mixtral and
  tiny_qwen3_moe: hidden 64 with widths that pack exactly into the CPU
  kernels' panels (so the tests run the kernel path), HF's logits over two 48-token sequences."""
  common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=0.1, bos_token_id=0, eos_token_id=1)
  families = [
      ("tiny_qwen3", transformers.Qwen3Config(
          head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
          **common), transformers.Qwen3ForCausalLM),
      ("tiny_mistral", transformers.MistralConfig(
          head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
          sliding_window=16, **common), transformers.MistralForCausalLM),
      ("tiny_phi3", transformers.Phi3Config(
          rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None,
          original_max_position_embeddings=256, **common), transformers.Phi3ForCausalLM),
  ]
  gemma2 = transformers.Gemma2Config(
      head_dim=16, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=2.0,
      final_logit_softcapping=3.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
      hidden_activation="gelu_pytorch_tanh", pad_token_id=None, **common)
  gemma2._attn_implementation = "eager"  # soft capping needs the eager attention
  families.append(("tiny_gemma2", gemma2, transformers.Gemma2ForCausalLM))
  gemma3 = transformers.Gemma3TextConfig(
      head_dim=16, query_pre_attn_scalar=24, sliding_window=16, rms_norm_eps=1e-6,
      tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", pad_token_id=None,
      layer_types=["sliding_attention", "full_attention"],
      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                          "rope_theta": 1000000.0}}, **common)
  families.append(("tiny_gemma3", gemma3, transformers.Gemma3ForCausalLM))
  mixtral = transformers.MixtralConfig(
      head_dim=16, num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0,
      rms_norm_eps=1e-5, tie_word_embeddings=False, **dict(common, intermediate_size=32))
  families.append(("tiny_mixtral", mixtral, transformers.MixtralForCausalLM))
  qwen3_moe = transformers.Qwen3MoeConfig(
      head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
      norm_topk_prob=False, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
      **common)
  families.append(("tiny_qwen3_moe", qwen3_moe, transformers.Qwen3MoeForCausalLM))
  for name, config, cls in families:
    config.torch_dtype = "float32"
    tiny_model(os.path.join(out, name), config, cls, None, lengths=(48, 48))


def main(argv):
  del argv
  out = os.path.abspath(FLAGS.out)
  if FLAGS.only_families:
    family_fixtures(out)
    print(f"family fixtures written to {out}", file=sys.stderr)
    return
  if FLAGS.only_chat_template:
    tiny_llama_chat(os.path.join(out, "tiny_llama_chat"))
    print(f"fixture written to {out}/tiny_llama_chat", file=sys.stderr)
    return
  if FLAGS.only_repetition_penalty:
    add_repetition_penalty(os.path.join(out, "smollm2_hf.json"))
    print(f"repetition_penalty added to {out}/smollm2_hf.json", file=sys.stderr)
    return
  llama = transformers.LlamaConfig(
      vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
  tiny_model(os.path.join(out, "tiny_llama"), llama, transformers.LlamaForCausalLM, "150KB")
  qwen2 = transformers.Qwen2Config(
      vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
  tiny_model(os.path.join(out, "tiny_qwen2"), qwen2, transformers.Qwen2ForCausalLM, None)
  family_fixtures(out)
  smollm_fixture(os.path.join(out, "smollm2_hf.json"))
  print(f"fixtures written to {out}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
