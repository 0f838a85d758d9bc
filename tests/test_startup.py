"""Start-up: the default server's program count, requests served while the warm-up compiles, a
warm restart that compiles nothing, and the start-up figures."""

import collections
import json
import os
import subprocess
import sys
import textwrap
import threading

from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from jaxtier.engine import build, startup
from jaxtier.engine.engine import ahead_programs, ready_programs, warmup_programs
from jaxtier.server import AsyncEngine, create_app

ROOT = os.path.join(os.path.dirname(__file__), "..")
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, num_device_blocks=16, num_host_blocks=0,
                   layer_execution="scan")


def test_the_default_server_runs_at_most_32_programs():
  plan = build.plan("smollm2-135m-instruct")
  keys = warmup_programs(plan.engine_config, plan.config.vocab_size)
  kinds = collections.Counter(key[0] for key in keys)
  assert len(keys) == len(set(keys)) <= 32, kinds
  assert set(kinds) == {"step", "sample_transformed", "swap"}
  steps = [key for key in keys if key[0] == "step"]
  decode = sorted(key[1] for key in steps if key[2] == 1)
  prefill = sorted(key[1] for key in steps if key[2] > 1)
  assert decode == [1, 2, 4, 8, 16, 24, 32, 48, 64]  # every batch size a server sees
  assert prefill == [1, 2, 4, 8, 16, 32, 64] and {key[2] for key in steps} == {1, 32}
  # An ordinary request's programs (decode and a short prefill at small batch) come first.
  ready = ready_programs(plan.engine_config, plan.config.vocab_size)
  assert {key[1:3] for key in ready} == {(1, 1), (2, 1), (1, 32), (2, 32)}
  assert [key for key in keys if key[0] == "step"][:len(ready)] == ready


def test_a_batch_builds_the_calls_its_requests_can_run_largest_prefill_first():
  config = build.plan("smollm2-135m-instruct").engine_config
  keys = ahead_programs(config, requests=24, prompt_rows=40)
  assert all(key[0] == "step" for key in keys) and len(set(keys)) == len(keys)
  assert sorted(key[1] for key in keys if key[2] == 1) == [1, 2, 4, 8, 16, 24]
  assert sorted(key[1] for key in keys if key[2] > 1) == [1, 2, 4, 8, 16, 32, 64]
  assert [key[1:3] for key in keys[:4]] == [(64, 32), (1, 1), (32, 32), (2, 1)]
  assert [key[1:3] for key in ahead_programs(config, 1, 1)] == [(1, 32), (1, 1)]
  everything = ahead_programs(config, 1000, 1000)  # never past the configuration's programs
  assert set(everything) == {key for key in warmup_programs(config, 1) if key[0] == "step"}


def test_the_offline_api_lowers_its_programs_beside_the_steps():
  """A batch's programs are lowered on a thread (on a CPU; compiled elsewhere) and the steps
  compile those lowerings; the tokens are those of programs built on the spot."""
  args = dict(ENGINE_ARGS, max_model_len=72, max_num_seqs=3)  # programs no other test builds
  llm = jaxtier.LLM(fixture_path("tiny_llama"), **args)
  engine = llm.engine
  prompts = [[5, 17, 42] * k for k in (1, 4, 9)]
  params = jaxtier.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
  for i, prompt in enumerate(prompts):
    engine.add_request(i, prompt, params, seed=0)
  ahead = engine.compile_ahead()
  assert ahead is not None and ahead.join(300) and ahead.error is None
  assert engine.compile_ahead() is None  # nothing new to build for the same requests
  tokens = {}
  while engine.num_unfinished:
    for update in engine.step():
      if update.completion is not None:
        tokens[update.request_id] = update.completion.token_ids
  stats = engine.stats()
  assert stats["compiled_variants"] >= 2
  assert stats["compile_lowered_ahead"] == stats["compiled_variants"]  # every one it ran
  reference = llm.run_batch([llm.make_request(p, params) for p in prompts])
  assert [tokens[i] for i in range(3)] == [c.token_ids for c in reference]
  engine.close()


def metric_values(client) -> dict[str, float]:
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=g-import-not-at-top
  text = client.get("/metrics").text
  return {s.name: s.value for family in text_string_to_metric_families(text)
          for s in family.samples}


def test_a_request_is_served_while_the_warmup_is_stuck(monkeypatch):
  """The warm-up thread holds on its first program: /health stays 503, yet a request compiles
  what it needs on the engine thread and completes, and /metrics shows the warm-up's progress."""
  llm = jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)
  release, original = threading.Event(), llm.engine.compile_programs

  def stuck(keys, progress=None):
    release.wait(120)
    original(keys, progress)

  monkeypatch.setattr(llm.engine, "compile_programs", stuck)
  engine = AsyncEngine(llm)
  try:
    client = TestClient(create_app(engine, "tiny"))
    assert client.get("/health").json() == {"status": "warming up"}
    response = client.post("/v1/completions", json={"prompt": [5, 17, 42], "max_tokens": 3,
                                                    "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"]) > 0
    values = metric_values(client)
    assert values["jaxtier_ready"] == 0 and values["jaxtier_warmup_programs_compiled"] == 0
    assert values["jaxtier_warmup_programs"] == len(warmup_programs(llm.engine_config,
                                                                    llm.engine.grammar_vocab))
    assert values["jaxtier_compile_programs_compiled_total"] + values[
        "jaxtier_compile_cache_hits_total"] >= 2  # the request's prefill and decode programs
    release.set()
    assert engine.wait_warm(timeout_s=300)
    assert client.get("/health").status_code == 200
    figures = llm.engine.stats()["startup"]
    assert figures["compile"]["done"] == figures["compile"]["programs"]
    assert 0 < figures["ready_seconds"] and figures["load_seconds"] > 0
    line = startup.startup_line(figures)
    assert line.startswith("start-up: size ") and "programs in" in line and "ready at" in line
  finally:
    release.set()
    engine.close()


_START = textwrap.dedent("""
    import collections, json, sys
    from jax import monitoring
    events = collections.Counter()
    monitoring.register_event_listener(lambda name, **_: events.update([name]))
    import jaxtier
    llm = jaxtier.LLM(sys.argv[1], **json.loads(sys.argv[2]))
    report = llm.engine.warmup()
    out = llm.generate([[5, 17, 42]], jaxtier.SamplingParams(max_tokens=3, temperature=0))
    print(json.dumps({"report": report, "tokens": list(out[0].outputs[0].token_ids),
                      "misses": events["/jax/compilation_cache/cache_misses"],
                      "hits": events["/jax/compilation_cache/cache_hits"]}))
""")


def test_a_second_start_compiles_nothing(tmp_path):
  """The same configuration started twice in fresh processes on one compilation cache: the first
  compiles every program, the second (as every later one) loads them all and compiles none, not
  even the small programs of loading and sizing."""
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
  runs = []
  for _ in range(2):
    proc = subprocess.run([sys.executable, "-c", _START, fixture_path("tiny_llama"),
                           json.dumps(ENGINE_ARGS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  first, second = runs
  programs = first["report"]["programs"]
  assert first["report"]["compiled"] == programs and first["misses"] > programs
  assert second["report"] == {**first["report"], "compiled": 0, "cache_hits": programs,
                              "compile_seconds": second["report"]["compile_seconds"]}
  assert second["misses"] == 0 and second["hits"] >= first["misses"]
  assert second["tokens"] == first["tokens"]


def test_a_cache_written_by_another_setup_is_named_in_the_log(tmp_path):
  folder = str(tmp_path)
  assert startup.cache_mismatch(folder) is None  # an empty folder: nothing to say
  assert startup.cache_mismatch(folder) is None  # the note it wrote is this process's
  note = os.path.join(folder, startup.CACHE_NOTE)
  with open(note, encoding="utf-8") as f:
    written = json.load(f)
  with open(note, "w", encoding="utf-8") as f:
    json.dump({**written, "jaxlib": "0.0.1"}, f)
  why = startup.cache_mismatch(folder)
  assert why is not None and "jaxlib '0.0.1'" in why and written["jaxlib"] in why
  assert startup.cache_mismatch(folder) is None  # rewritten for the next start
