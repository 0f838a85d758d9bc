"""The disk tier under the host tier (`kv_disk_path`): prefix blocks that outlive the engine.

Every output is compared with an engine that has prefix caching off (the reference: nothing
cached, everything computed); the hits are read from `stats()`.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import jaxtier
from conftest import fixture_path
from jaxtier.engine import disk_tier
from test_engine import GREEDY, assert_all_free, engine_of, prompts_of, run, tiny  # noqa: F401

PROMPTS = prompts_of((41, 37, 50, 23), seed=7)


@pytest.fixture(scope="module")
def reference(tiny):
  model, tokenizer = tiny
  out = run(engine_of(model, tokenizer, enable_prefix_caching=False), PROMPTS, GREEDY)
  return [out[i].token_ids for i in range(len(PROMPTS))]


def disk_run(model, tokenizer, path, **overrides) -> tuple[list, dict]:
  """One engine's life on the disk tier at `path`: runs PROMPTS, waits for its writes, closes."""
  engine = engine_of(model, tokenizer, kv_disk_path=str(path), **overrides)
  out = run(engine, PROMPTS, GREEDY)
  engine.flush_disk()
  stats = engine.stats()
  assert_all_free(engine)
  engine.close()
  return [out[i].token_ids for i in range(len(PROMPTS))], stats


def block_files(path) -> list[str]:
  return sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                for name in names if name.endswith(".kvb"))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_a_restarted_engine_reads_the_prompts_from_disk_and_answers_the_same(tiny, reference,
                                                                            tmp_path,
                                                                            kv_cache_dtype):
  model, tokenizer = tiny
  if kv_cache_dtype != "float32":  # int8 blocks carry their scales to disk and back
    out = run(engine_of(model, tokenizer, enable_prefix_caching=False,
                        kv_cache_dtype=kv_cache_dtype), PROMPTS, GREEDY)
    reference = [out[i].token_ids for i in range(len(PROMPTS))]
  cold, cold_stats = disk_run(model, tokenizer, tmp_path, kv_cache_dtype=kv_cache_dtype)
  assert cold == reference
  full_blocks = sum((len(p) - 1) // 4 for p in PROMPTS)
  assert cold_stats["disk_hit_tokens"] == 0
  assert cold_stats["disk_blocks_written"] == len(block_files(tmp_path)) >= full_blocks
  warm, warm_stats = disk_run(model, tokenizer, tmp_path, kv_cache_dtype=kv_cache_dtype)
  assert warm == reference
  assert warm_stats["disk_hit_tokens"] == full_blocks * 4
  assert warm_stats["prefix_host_hit_tokens"] == full_blocks * 4  # loaded as host-tier hits
  assert warm_stats["disk_blocks_written"] == 0 and warm_stats["disk_corrupt_files"] == 0


def test_a_flipped_byte_is_a_miss_counted_and_removed_and_the_output_stays(tiny, reference,
                                                                          tmp_path):
  model, tokenizer = tiny
  disk_run(model, tokenizer, tmp_path)
  files = block_files(tmp_path)
  victim = files[len(files) // 2]
  with open(victim, "r+b") as f:
    f.seek(-3, os.SEEK_END)
    byte = f.read(1)
    f.seek(-3, os.SEEK_END)
    f.write(bytes([byte[0] ^ 0x40]))
  out, stats = disk_run(model, tokenizer, tmp_path)
  assert out == reference
  assert stats["disk_corrupt_files"] == 1
  assert 0 < stats["disk_hit_tokens"] < sum((len(p) - 1) // 4 for p in PROMPTS) * 4
  assert not os.path.exists(victim) or stats["disk_blocks_written"] >= 1  # rewritten if at all


@pytest.mark.parametrize("overrides", [
    {"kv_cache_dtype": "bfloat16"}, {"block_size": 8}, {"changed_tensor": True}])
def test_another_kv_layout_or_changed_weights_get_no_hits(tiny, tmp_path, overrides):
  model, tokenizer = tiny
  disk_run(model, tokenizer, tmp_path)
  overrides = dict(overrides)
  if overrides.pop("changed_tensor", False):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    leaves[-1] = leaves[-1] + 1e-3  # one tensor changed
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  _, stats = disk_run(model, tokenizer, tmp_path, **overrides)
  assert stats["disk_hit_tokens"] == 0 and stats["disk_reads"] == 0
  assert len(os.listdir(tmp_path)) >= 2  # a namespace of its own beside the first


def test_a_weight_update_moves_the_engine_to_a_new_namespace(tiny, reference, tmp_path):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, kv_disk_path=str(tmp_path))
  run(engine, PROMPTS, GREEDY)
  engine.flush_disk()
  first = engine.disk.namespace
  _, state = nnx.split(model)
  changed = jax.tree.map(lambda a: a * 1.01, state)
  engine.update_weights(changed)
  assert engine.disk.namespace != first
  run(engine, PROMPTS, GREEDY)
  assert engine.stats()["disk_hit_tokens"] == 0
  engine.update_weights(state)  # back to the first weights: their namespace and its blocks
  assert engine.disk.namespace == first
  out = run(engine, PROMPTS, GREEDY)
  assert [out[i].token_ids for i in range(len(PROMPTS))] == reference
  assert engine.stats()["disk_hit_tokens"] > 0
  engine.close()


def test_a_checkpoint_with_one_tensor_changed_has_another_checksum(tmp_path):
  source = fixture_path("tiny_llama")
  copy = tmp_path / "copy"
  shutil.copytree(source, copy)
  cache = str(tmp_path / "checksums.json")
  before = disk_tier.file_digest(str(copy), cache)
  assert disk_tier.file_digest(str(copy), cache) == before  # from the cache
  weights = max((p for p in copy.iterdir() if p.suffix == ".safetensors"),
                key=lambda p: p.stat().st_size)
  data = bytearray(weights.read_bytes())
  data[-5] ^= 1
  weights.write_bytes(bytes(data))
  assert disk_tier.file_digest(str(copy), cache) != before


def test_int8_weights_of_the_same_checkpoint_and_another_model_get_no_hits(tmp_path):
  prompt = list(range(3, 60))
  params = jaxtier.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
  hits = []
  for model, kwargs in (("tiny_mistral", {}), ("tiny_mistral", {}),
                        ("tiny_mistral", {"quantization": "int8"}), ("tiny_llama", {})):
    llm = jaxtier.LLM(fixture_path(model), max_model_len=128, num_host_blocks=32,
                      kv_disk_path=str(tmp_path), **kwargs)
    llm.generate([prompt], params, use_tqdm=False)
    llm.engine.flush_disk()
    hits.append(llm.stats()["disk_hit_tokens"])
    assert llm.memory_report()["kv_disk_path"] == str(tmp_path)
    llm.engine.close()
  assert hits[0] == 0 and hits[1] > 0 and hits[2] == hits[3] == 0


CHILD = """
import sys
sys.path.insert(0, "tests")
from test_engine import engine_of, prompts_of, GREEDY
from jaxtier import checkpoint
from conftest import fixture_path
loaded = checkpoint.load(fixture_path("tiny_llama"), "float32")
engine = engine_of(loaded.model, loaded.tokenizer, kv_disk_path=sys.argv[1], max_model_len=256)
for i, prompt in enumerate(prompts_of([200] * 400, seed=11)):
  engine.add_request(i, prompt, GREEDY, 0)
  while engine.has_unfinished():
    engine.step()
"""


def test_a_kill_during_writes_leaves_nothing_that_changes_an_answer(tiny, tmp_path):
  model, tokenizer = tiny
  child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=os.getcwd(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120
  while len(block_files(tmp_path)) < 300 and time.monotonic() < deadline:
    time.sleep(0.05)
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert len(block_files(tmp_path)) >= 300
  # a torn file, as a crash of the machine (not only the process) may leave one
  torn = block_files(tmp_path)[0]
  with open(torn, "r+b") as f:
    f.truncate(os.path.getsize(torn) // 2)
  prompts = prompts_of([200] * 6, seed=11)
  ref = run(engine_of(model, tokenizer, enable_prefix_caching=False, max_model_len=256), prompts,
            GREEDY)
  engine = engine_of(model, tokenizer, kv_disk_path=str(tmp_path), max_model_len=256)
  out = run(engine, prompts, GREEDY)
  stats = engine.stats()
  engine.close()
  assert all(out[i].token_ids == ref[i].token_ids for i in range(len(prompts)))
  assert stats["disk_corrupt_files"] >= 1 and stats["disk_hit_tokens"] > 0
  # the torn file was removed at start-up (and written again, whole, if a prompt computed it):
  # every file left has the one size of this namespace's files
  assert not [name for _, _, names in os.walk(tmp_path) for name in names
              if name.endswith(".tmp")]
  assert np.all([os.path.getsize(p) == os.path.getsize(block_files(tmp_path)[0])
                 for p in block_files(tmp_path)])


def test_a_restarted_server_serves_the_prompt_from_disk_with_the_same_answer(tmp_path):
  import asyncio  # pylint: disable=import-outside-toplevel

  import httpx  # pylint: disable=import-outside-toplevel
  from server_support import cold_app  # pylint: disable=import-outside-toplevel

  body = {"model": "tiny", "prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 6,
          "temperature": 0}

  def serve(**kwargs) -> tuple[str, dict]:
    llm = jaxtier.LLM(fixture_path("tiny_llama_chat"), max_model_len=256, **kwargs)
    with cold_app(llm, "tiny") as app:
      async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
          reply = (await http.post("/v1/completions", json=body)).json()
          metrics = (await http.get("/metrics")).text
        return reply, metrics
      reply, metrics = asyncio.run(go())
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("jaxtier_disk_")}
    assert "choices" in reply, reply
    return reply["choices"][0]["text"], values

  cold, cold_metrics = serve(kv_disk_path=str(tmp_path))  # closing the server flushes the writes
  warm, warm_metrics = serve(kv_disk_path=str(tmp_path))
  reference, _ = serve(enable_prefix_caching=False)
  assert cold == warm == reference
  assert cold_metrics["jaxtier_disk_hit_tokens_total"] == 0
  assert cold_metrics["jaxtier_disk_written_bytes_total"] > 0
  assert warm_metrics["jaxtier_disk_hit_tokens_total"] >= 100


def test_the_scheduler_reads_the_blocks_after_the_hits_and_books_host_blocks_for_them():
  from jaxtier import scheduler  # pylint: disable=import-outside-toplevel
  from jaxtier.scheduler import prefix  # pylint: disable=import-outside-toplevel
  config = scheduler.SchedulerConfig(
      num_device_blocks=32, num_host_blocks=3, block_size=4, max_num_seqs=4,
      max_num_batched_tokens=64, watermark=0.0, preemption_mode="swap",
      victim_policy="longest_waiting", enable_prefix_caching=True, host_prefix_caching=True,
      disk_tier=True)
  prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, the last token in block 5
  hashes = prefix.block_hashes(prompt, 4)
  request = scheduler.Request("a", prompt_len=len(prompt), max_tokens=2, prompt_token_ids=prompt)
  state = scheduler.initial_state(config)
  assert scheduler.disk_lookup(state, request) == ()
  state = scheduler.apply_event(state, scheduler.DiskIndexed(added=hashes[:2] + hashes[3:]))
  assert scheduler.disk_lookup(state, request) == hashes[:2]  # stops at the first it lacks
  state = scheduler.apply_event(state, scheduler.DiskIndexed(added=hashes[2:3]))
  assert scheduler.disk_lookup(state, request) == hashes  # all 5: the last token is in none
  short = scheduler.Request("b", prompt_len=20, max_tokens=2, prompt_token_ids=prompt[:20])
  assert scheduler.disk_lookup(state, short) == hashes[:4]  # never the block of the last token
  state = scheduler.apply_event(state, scheduler.Arrive(request, held=True))
  state = scheduler.apply_event(state, scheduler.DiskLoaded("a", hashes))
  assert len(state.disk_fills) == 3  # the host pool's room; the rest are recomputed
  assert [h for h, _ in state.disk_fills] == list(hashes[:3])
  assert scheduler.disk_lookup(state, request) == hashes[3:]  # after the host hits now
  state = scheduler.apply_event(state, scheduler.Release("a"))
  state, plan = scheduler.schedule(state)
  assert plan.disk_fills == tuple(zip(hashes[:3], (b for _, b in plan.disk_fills)))
  assert plan.prefetch and len(plan.prefetch) == 3  # host-tier hits from here on
  assert not state.disk_fills


def test_a_small_budget_keeps_the_namespace_within_it_plus_one_block(tiny, reference, tmp_path):
  model, tokenizer = tiny
  _, stats = disk_run(model, tokenizer, tmp_path)
  file_bytes = stats["disk_bytes"] // stats["disk_blocks"]
  budget_blocks = 7
  out, stats = disk_run(model, tokenizer, tmp_path / "small",
                        kv_disk_gb=budget_blocks * file_bytes / 1e9)
  assert out == reference
  assert len(block_files(tmp_path / "small")) <= budget_blocks + 1
  assert stats["disk_evictions"] >= stats["disk_blocks_written"] - budget_blocks - 1 > 0


def test_kv_disk_path_needs_the_host_tier():
  from jaxtier.engine.args import EngineArgs  # pylint: disable=import-outside-toplevel
  for kwargs, message in (({"host_prefix_caching": False}, "host_prefix_caching"),
                          ({"num_host_blocks": 0}, "host pool"), ({"kv_disk_gb": 0}, "kv_disk_gb")):
    with pytest.raises(ValueError, match=message):
      EngineArgs(kv_disk_path="/tmp/x", **kwargs)


WRITER = """
import json, sys
sys.path.insert(0, "tests")
from test_engine import engine_of, prompts_of, run, GREEDY
from jaxtier import checkpoint
from conftest import fixture_path
loaded = checkpoint.load(fixture_path("tiny_llama"), "float32")
engine = engine_of(loaded.model, loaded.tokenizer, kv_disk_path=sys.argv[1], max_model_len=256)
out = run(engine, prompts_of([120] * 12, seed=5), GREEDY)
engine.flush_disk()
print(json.dumps([out[i].token_ids for i in range(12)]))
"""


def test_two_processes_writing_the_same_prefixes_both_finish_with_the_same_outputs(tiny,
                                                                                  tmp_path):
  import json  # pylint: disable=import-outside-toplevel

  procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=os.getcwd(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
           for _ in range(2)]
  outputs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
  assert all(p.returncode == 0 for p in procs)
  model, tokenizer = tiny
  ref = run(engine_of(model, tokenizer, enable_prefix_caching=False, max_model_len=256),
            prompts_of([120] * 12, seed=5), GREEDY)
  assert outputs[0] == outputs[1] == [list(ref[i].token_ids) for i in range(12)]
  (namespace,) = [d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)]
  engine = engine_of(model, tokenizer, kv_disk_path=str(tmp_path), max_model_len=256)
  store = engine.disk.store
  assert len(store) == len(block_files(tmp_path)) >= 12 * 29
  assert all(store.read(h) is not None for h in store.hashes())
  assert store.figures()["disk_corrupt_files"] == 0 and namespace == engine.disk.namespace
  engine.close()


def test_blocks_another_process_wrote_after_this_one_started_are_found(tiny, reference, tmp_path):
  model, tokenizer = tiny
  server = engine_of(model, tokenizer, kv_disk_path=str(tmp_path))  # scans an empty directory
  disk_run(model, tokenizer, tmp_path)  # a batch job beside it writes the prompts
  out = run(server, PROMPTS, GREEDY)
  assert [out[i].token_ids for i in range(len(PROMPTS))] == reference
  assert server.stats()["disk_hit_tokens"] == sum((len(p) - 1) // 4 for p in PROMPTS) * 4
  server.close()
