"""The OpenAI-compatible server on the tiny Llama, against `jaxtier.LLM` as the reference."""

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import jaxtier
from conftest import fixture_path
from server_support import free_port, uvicorn_on_localhost, wait_until_healthy, warm_engine
from jaxtier.server import AsyncEngine, EngineError, create_app
from jaxtier.server.stream_text import IncrementalDetokenizer, stop_prefix_len

MODEL = "tiny"
SERVE = os.path.join(os.path.dirname(__file__), "..", "scripts", "serve.py")
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, layer_execution="scan")


def greedy(**kwargs) -> jaxtier.SamplingParams:
  return jaxtier.SamplingParams(**{"temperature": 0, "ignore_eos": True, **kwargs})


def checkpoint_bytes(prefix: str = "") -> int:
  """Bytes of the tiny checkpoint's tensors whose names start with `prefix`, read from the
  safetensors headers on disk: a count that does not go through the engine."""
  total = 0
  for name in os.listdir(fixture_path("tiny_llama")):
    if not name.endswith(".safetensors"):
      continue
    with open(fixture_path("tiny_llama", name), "rb") as f:
      header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    total += sum(entry["data_offsets"][1] - entry["data_offsets"][0]
                 for key, entry in header.items()
                 if key != "__metadata__" and key.startswith(prefix))
  return total


def rotary_bytes(llm) -> int:
  """The model state holds the rotary inverse frequencies (head_dim / 2 float32) beside the
  checkpoint's tensors."""
  return llm.config.head_dim // 2 * 4


@pytest.fixture(scope="module")
def llm():
  """The offline reference (an engine of its own: the server's is stepped by its thread)."""
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def served():
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def engine(served):
  with warm_engine(served) as engine:
    yield engine


@pytest.fixture(scope="module")
def app(engine):
  return create_app(engine, MODEL)


@pytest.fixture(scope="module")
def client(app):
  return TestClient(app)


def events(response) -> list:
  """The JSON payloads of a server-sent event stream, checking it ends with [DONE]."""
  lines = [line for line in response.iter_lines() if line]
  assert all(line.startswith("data: ") for line in lines)
  assert lines[-1] == "data: [DONE]"
  return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def complete(client, **body) -> dict:
  response = client.post("/v1/completions", json={"model": MODEL, **body})
  assert response.status_code == 200, response.text
  return response.json()


def metric_values(client) -> dict[str, float]:
  text = client.get("/metrics").text
  return {(s.name + "".join(f"{{{k}={v}}}" for k, v in s.labels.items())): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_and_health(client):
  assert client.get("/health").status_code == 200
  models = client.get("/v1/models").json()
  assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
  assert models["data"][0]["object"] == "model" and models["data"][0]["owned_by"] == "jaxtier"
  assert models["data"][0]["max_model_len"] == ENGINE_ARGS["max_model_len"] == 64


@pytest.mark.parametrize("prompts", [["A tiny model", "Once upon a time", "Hi"],
                                     [[5, 17, 42], [1, 2, 3, 4, 5]]])
def test_greedy_completions_equal_llm_generate(client, llm, prompts):
  body = complete(client, prompt=prompts, max_tokens=12, temperature=0, ignore_eos=True)
  reference = llm.generate(prompts, greedy(max_tokens=12))
  assert body["object"] == "text_completion"
  assert [c["text"] for c in body["choices"]] == [o.text for o in reference]
  assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
  assert {c["finish_reason"] for c in body["choices"]} == {"length"}
  prompt_tokens = sum(len(o.prompt_token_ids) for o in reference)
  generated = 12 * len(prompts)
  details = body["usage"].pop("prompt_tokens_details")
  assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                           "total_tokens": prompt_tokens + generated}
  assert 0 <= details["cached_tokens"] < prompt_tokens


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
  prompt = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 can be reused (never the last)
  request = dict(prompt=prompt, max_tokens=2, temperature=0, ignore_eos=True)
  complete(client, **request)
  before = metric_values(client)
  for stream in (False, True):
    if stream:
      with client.stream("POST", "/v1/completions", json={
          "model": MODEL, **request, "stream": True,
          "stream_options": {"include_usage": True}}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
      usage = json.loads(lines[-1][len("data: "):])["usage"]
    else:
      usage = complete(client, **request)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
  after = metric_values(client)
  moved = lambda name: after[name] - before.get(name, 0)
  assert moved("jaxtier_prefix_cache_hits_total{tier=device}") == 64
  assert moved("jaxtier_prefix_cache_queries_total") == 80
  assert after["jaxtier_kv_device_blocks_cached"] >= 2
  assert "jaxtier_prefix_cache_host_bytes_total{direction=load}" in after


def test_single_prompt_forms_equal_llm_generate(client, llm):
  reference = llm.generate([5, 17, 42], greedy(max_tokens=6))[0].text
  for prompt in ([5, 17, 42], [[5, 17, 42]]):
    body = complete(client, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True)
    assert [c["text"] for c in body["choices"]] == [reference]


def test_seeded_sampling_with_n_choices_equals_llm_generate(client, llm):
  body = complete(client, prompt="Hello, world!", max_tokens=10, temperature=0.9, top_k=50,
                  seed=3, n=2)
  reference = llm.generate(["Hello, world!"] * 2, [
      jaxtier.SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=seed)
      for seed in (3, 4)])
  assert [c["text"] for c in body["choices"]] == [o.text for o in reference]


def test_streamed_and_whole_completions_equal_llm_generate(client, llm):
  reference = llm.generate("A tiny model", greedy(max_tokens=16))[0]
  prompt_tokens = len(reference.prompt_token_ids)
  usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
           "total_tokens": prompt_tokens + 16, "prompt_tokens_details": {"cached_tokens": 0}}
  request = dict(prompt="A tiny model", max_tokens=16, temperature=0, ignore_eos=True)
  whole = complete(client, **request)
  assert whole["choices"][0]["text"] == reference.text and whole["usage"] == usage
  with client.stream("POST", "/v1/completions",
                     json={**request, "stream": True,
                           "stream_options": {"include_usage": True}}) as response:
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
  texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
  assert len([t for t in texts if t]) > 1
  assert "".join(texts) == reference.text
  assert all(c["object"] == "text_completion" for c in chunks)
  assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [
      "length"]
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def test_chat_equals_llm_chat_streamed_and_not(client, llm):
  conversation = [{"role": "user", "content": "hi"}]
  reference = llm.chat(conversation, greedy(max_tokens=10))[0]
  request = {"model": MODEL, "max_completion_tokens": 10, "temperature": 0, "ignore_eos": True,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
  body = client.post("/v1/chat/completions", json=request).json()
  assert body["object"] == "chat.completion"
  assert body["choices"][0]["message"] == {"role": "assistant", "content": reference.text}
  assert body["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
  assert body["usage"]["completion_tokens"] == len(reference.token_ids) == 10
  with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
    chunks = events(response)
  deltas = [c["choices"][0]["delta"] for c in chunks]
  assert deltas[0] == {"role": "assistant", "content": ""}
  assert all("role" not in d for d in deltas[1:])
  assert "".join(d.get("content", "") for d in deltas) == reference.text
  assert chunks[-1]["choices"][0]["finish_reason"] == reference.finish_reason
  assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_stop_strings_truncate_and_are_never_streamed(client, llm):
  unstopped = llm.generate("A tiny model", greedy(max_tokens=20))[0].text
  assert "Z23" in unstopped  # the fixture model's greedy text, which the stop below must cut
  reference = llm.generate("A tiny model", greedy(max_tokens=20, stop=["Z23", "never"]))[0]
  assert reference.finish_reason == "stop" and reference.text == unstopped[:unstopped.find("Z23")]
  request = dict(prompt="A tiny model", max_tokens=20, temperature=0, ignore_eos=True,
                 stop=["Z23", "never"])
  assert complete(client, **request)["choices"][0]["text"] == reference.text
  with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
    texts = [c["choices"][0]["text"] for c in events(response)]
  assert "".join(texts) == reference.text and "Z" not in "".join(texts)


def test_incremental_detokenizer_waits_for_whole_characters(llm):
  tokenizer = llm.tokenizer
  ids = tokenizer.encode("héllo ñ 日本 ✓", add_special_tokens=False)
  detokenizer = IncrementalDetokenizer(tokenizer, stops=())
  deltas = [detokenizer.push([i]) for i in ids]
  assert len(ids) > len("héllo ñ 日本 ✓".encode()) // 2  # multi-byte characters span tokens
  assert not any("\ufffd" in d for d in deltas)
  assert "".join(deltas) + detokenizer.finish(tokenizer.decode(ids)) == "héllo ñ 日本 ✓"
  assert stop_prefix_len("abcZ2", ["Z23", "c"]) == 2 and stop_prefix_len("abc", ["Z23"]) == 0


def test_offloaded_engine_serves_the_llm_tokens_and_counts_streamed_bytes(llm):
  offloaded = jaxtier.LLM(fixture_path("tiny_llama"), offload_tail_layers=1, prefetch_depth=1,
                          **ENGINE_ARGS)
  tail_bytes = checkpoint_bytes(f"model.layers.{offloaded.config.num_layers - 1}.")
  engine = AsyncEngine(offloaded, warmup=False)
  try:
    offload_client = TestClient(create_app(engine, MODEL))
    prompts = ["A tiny model", "Once upon a time"]
    body = complete(offload_client, prompt=prompts, max_tokens=12, temperature=0, ignore_eos=True)
    reference = llm.generate(prompts, greedy(max_tokens=12))  # the resident engine, offline
    assert [c["text"] for c in body["choices"]] == [o.text for o in reference]
    before = metric_values(offload_client)
    assert before["jaxtier_host_weight_bytes"] == tail_bytes
    assert before["jaxtier_device_weight_bytes"] == (
        checkpoint_bytes() - tail_bytes + rotary_bytes(offloaded))
    one = complete(offload_client, prompt=[1, 2, 3], max_tokens=7, temperature=0, ignore_eos=True)
    after = metric_values(offload_client)
  finally:
    engine.close()
  steps = one["usage"]["completion_tokens"]  # one row: one model step per generated token
  assert steps == 7
  assert after["jaxtier_model_steps_total"] - before["jaxtier_model_steps_total"] == steps
  assert (after["jaxtier_weight_transfer_bytes_total"]
          - before["jaxtier_weight_transfer_bytes_total"]) == steps * tail_bytes


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400,
     "logprobs must be an integer in [0, 20] (OpenAI allows up to 5; this server, like vLLM"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, 400,
     "max_tokens must be an integer >= 1, got 0"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of=3 is not supported"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, 400,
     "frequency_penalty must be a number in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "min_q": 0.1}, 400, "min_q is not a supported field"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}, 404,
     "The model `\\ud800` does not exist"),
    ("/v1/completions", {"prompt": "x", "\udc00": 1}, 400, "unable to parse raw data as a unicode"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt 0 is empty"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt: expected a string"),
    ("/v1/completions", {"prompt": [[1, 2], [999]]}, 400, "prompt 1 has token ids outside"),
    ("/v1/completions", {"prompt": "word " * 80}, 400, "the context window max_model_len is 64"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 62}, 400,
     "you requested 65 tokens (3 in the prompt, 62 in the completion)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 64}, 400, "maximum context length is 64"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options is only allowed together with stream=true"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages: List should have at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "tools.0.type: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "frobnicate"}}}}, 400,
     "response_format.json_schema.schema is invalid"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs.regex is invalid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs requires logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400,
     "top_logprobs must be an integer in [0, 20]"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_bad_input_gets_an_openai_error(client, path, body, status, message):
  response = client.post(path, content=json.dumps(body),  # ASCII JSON: lone surrogates escaped
                         headers={"content-type": "application/json"})
  assert response.status_code == status
  error = response.json()["error"]
  assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
  assert error["type"] == "invalid_request_error"


def test_server_answers_after_bad_input(client, llm):
  response = client.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
  assert response.status_code == 400 and "error" in response.json()
  body = complete(client, prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True)
  reference = llm.generate("Once upon a time", greedy(max_tokens=5))[0]
  assert body["choices"][0]["text"] == reference.text


def test_concurrent_requests_equal_sequential_ones(app, llm):
  prompts = ["A tiny model", "Once upon a time", "Hello, world!", [5, 17, 42], "Caches page", "Hi"]

  async def run_all():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
      responses = await asyncio.gather(*[
          http.post("/v1/completions", json={"prompt": p, "max_tokens": 4 + i, "temperature": 0,
                                             "ignore_eos": True})
          for i, p in enumerate(prompts)])
    return [r.json()["choices"][0]["text"] for r in responses]

  sequential = [llm.generate(p, greedy(max_tokens=4 + i))[0].text for i, p in enumerate(prompts)]
  assert asyncio.run(run_all()) == sequential


def _blocks_all_free(engine) -> bool:
  figures = engine.engine.stats()
  return (figures["device_blocks_free"] == figures["device_blocks_total"]
          and figures["host_blocks_free"] == figures["host_blocks_total"])


async def _until(predicate, timeout_s: float = 60.0) -> None:
  """Yields to the event loop until `predicate()` holds (the engine thread works meanwhile)."""
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    await asyncio.sleep(0.005)


def test_a_short_request_joins_a_running_long_one(engine, served, llm):
  prompt = served.prompt_token_ids("Once upon a time")

  async def scenario():
    long = engine.generate(served.make_request(prompt, greedy(max_tokens=48)))
    first = await anext(long)
    short = [u async for u in engine.generate(served.make_request([5, 17, 42],
                                                                  greedy(max_tokens=3)))]
    rest = [u async for u in long]
    return first, short, rest

  first, short, rest = asyncio.run(scenario())
  assert short[-1].completion.token_ids == llm.generate([[5, 17, 42]],
                                                        greedy(max_tokens=3))[0].token_ids
  assert len(rest) >= 40  # the long request was still running when the short one ended
  tokens = first.new_token_ids + tuple(t for u in rest for t in u.new_token_ids)
  assert tokens == llm.generate("Once upon a time", greedy(max_tokens=48))[0].token_ids


def test_over_loopback_a_short_request_finishes_while_a_long_one_streams(app, engine, llm):
  with uvicorn_on_localhost(app) as port:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    long = api.completions.create(model=MODEL, prompt=[5, 17], max_tokens=60, temperature=0,
                                  stream=True, extra_body=extra)
    chunks = [next(iter(long))]
    short = api.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                   extra_body=extra)
    still_running = engine.stats().running  # as of the engine's last step
    chunks += list(long)
  assert short.choices[0].text == llm.generate("Hi", greedy(max_tokens=3))[0].text
  assert still_running == 1  # the long request had most of its 60 tokens to go
  assert "".join(c.choices[0].text for c in chunks) == llm.generate(
      [[5, 17]], greedy(max_tokens=60))[0].text


def test_no_compile_after_ready(engine, client):
  runner = engine.engine.runner
  compiled = runner.compile_seconds
  prompts = ["A tiny model", "Once upon a time", list(range(1, 40)), [5, 17, 42], "Hi"]

  async def run_all():
    transport = httpx.ASGITransport(app=client.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
      return await asyncio.gather(*[
          http.post("/v1/completions", json={"prompt": p, "max_tokens": 3 + 2 * i, "n": 1 + i % 3,
                                             "temperature": 0.5 * (i % 2), "ignore_eos": True,
                                             "logprobs": i % 3 or None, "echo": i == 2})
          for i, p in enumerate(prompts)])

  assert [r.status_code for r in asyncio.run(run_all())] == [200] * len(prompts)
  assert runner.compile_seconds == compiled


def test_health_is_503_until_warm():
  served = jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)
  release = threading.Event()
  compile_programs = served.engine.compile_programs

  def held_warmup(keys, progress=None):  # the warm-up thread's compiles, held
    assert release.wait(timeout=60)
    return compile_programs(keys, progress)

  served.engine.compile_programs = held_warmup
  warming = AsyncEngine(served)
  try:
    warming_client = TestClient(create_app(warming, MODEL))
    response = warming_client.get("/health")
    assert response.status_code == 503 and response.json() == {"status": "warming up"}
    assert metric_values(warming_client)["jaxtier_ready"] == 0
    release.set()
    assert warming.wait_ready(timeout_s=120)
    assert warming_client.get("/health").status_code == 200
    assert metric_values(warming_client)["jaxtier_ready"] == 1
  finally:
    release.set()
    warming.close()


def test_abort_frees_the_blocks_at_once(engine, served, llm):
  ids = served.prompt_token_ids("A tiny model")

  async def scenario():
    running = engine.generate(served.make_request(ids, greedy(max_tokens=40)))
    first = await anext(running)
    await running.aclose()
    await _until(lambda: engine.stats().running == 0 and engine.stats().steps > 0)
    return first

  first = asyncio.run(scenario())
  unaborted = llm.generate("A tiny model", greedy(max_tokens=40))[0].token_ids
  assert first.new_token_ids == unaborted[:len(first.new_token_ids)]
  assert _blocks_all_free(engine)
  assert engine.engine.stats()["requests_aborted"].get("client_abort", 0) >= 1


def test_a_failing_step_is_an_error_and_the_engine_keeps_serving(llm):
  served = jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)
  fail = (7, 7, 7)
  engine = AsyncEngine(served, warmup=False)
  step = engine.engine.runner.step

  def failing_step(cache, arrays):
    if any(tuple(row[:3]) == fail for row in arrays.tokens_bt.tolist()):
      raise RuntimeError("injected failure")
    return step(cache, arrays)

  engine.engine.runner.step = failing_step
  try:
    failing = TestClient(create_app(engine, MODEL))
    response = failing.post("/v1/completions", json={"prompt": list(fail)})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "injected failure" in response.json()["error"]["message"]
    with failing.stream("POST", "/v1/completions",
                        json={"prompt": list(fail), "stream": True}) as r:
      assert "injected failure" in events(r)[-1]["error"]["message"]
    body = complete(failing, prompt="Hi", max_tokens=3, temperature=0, ignore_eos=True)
    assert body["choices"][0]["text"] == llm.generate("Hi", greedy(max_tokens=3))[0].text
    assert _blocks_all_free(engine)
  finally:
    engine.close()
  async def too_late():
    engine.generate(served.make_request([1, 2], greedy()))

  with pytest.raises(EngineError, match="shutting down"):
    asyncio.run(too_late())


def test_a_full_queue_answers_429_and_then_serves():
  one_at_a_time = jaxtier.LLM(fixture_path("tiny_llama"), **{**ENGINE_ARGS, "max_num_seqs": 1})
  engine = AsyncEngine(one_at_a_time, max_queued_requests=1, warmup=False)
  app = create_app(engine, MODEL)
  body = {"prompt": "A tiny model", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

  async def scenario():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
      running = asyncio.ensure_future(http.post("/v1/completions", json=body))
      await _until(lambda: engine.stats().running == 1)
      queued = asyncio.ensure_future(http.post("/v1/completions", json=body))
      await _until(lambda: engine.stats().waiting == 1)
      refused = await http.post("/v1/completions", json=body)
      return refused, await running, await queued

  try:
    refused, running, queued = asyncio.run(scenario())
    after = TestClient(app).post("/v1/completions", json=body)
  finally:
    engine.close()
  assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
  assert refused.json()["error"]["code"] == "rate_limit_exceeded"
  assert "max_queued_requests" in refused.json()["error"]["message"]
  expected = one_at_a_time.tokenizer.decode(
      jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS).generate(
          "A tiny model", greedy(max_tokens=40))[0].token_ids)
  for response in (running, queued, after):
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected


def test_drain_ends_running_requests_with_abort(llm):
  served = jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)
  engine = AsyncEngine(served, warmup=False)
  release, step = threading.Event(), served.engine.step
  calls = []

  def held_step():
    calls.append(1)
    if len(calls) > 1:
      assert release.wait(timeout=60)
    return step()

  served.engine.step = held_step
  ids = served.prompt_token_ids("A tiny model")

  async def scenario():
    stream = engine.generate(served.make_request(ids, greedy(max_tokens=40)))
    updates = [await anext(stream)]
    drained = asyncio.get_running_loop().run_in_executor(None, engine.drain, 0.0)
    await _until(lambda: not engine.accepting)
    with pytest.raises(EngineError, match="shutting down"):
      engine.generate(served.make_request(ids, greedy()))
    release.set()
    updates += [u async for u in stream]
    return updates, await drained

  try:
    updates, ended = asyncio.run(scenario())
  finally:
    release.set()
    engine.close()
  assert ended == 1
  completion = updates[-1].completion
  assert completion.finish_reason == "abort" and 1 <= len(completion.token_ids) < 40
  assert completion.token_ids == llm.generate("A tiny model", greedy(max_tokens=40))[0].token_ids[
      :len(completion.token_ids)]


def test_metrics_count_requests_and_tokens(client, served):
  before = metric_values(client)
  for name in ("jaxtier_requests_running", "jaxtier_requests_waiting",
               "jaxtier_weight_transfer_bytes_total", "jaxtier_device_weight_bytes",
               "jaxtier_host_weight_bytes", "jaxtier_time_to_first_token_seconds_count",
               "jaxtier_e2e_request_latency_seconds_count", "jaxtier_kv_device_blocks_used",
               "jaxtier_kv_device_blocks_total", "jaxtier_kv_host_blocks_used",
               "jaxtier_kv_host_blocks_total", "jaxtier_swap_out_total", "jaxtier_swap_in_total",
               "jaxtier_swap_out_bytes_total", "jaxtier_swap_in_bytes_total",
               "jaxtier_swap_seconds_total", "jaxtier_preemptions_total{mode=swap}",
               "jaxtier_preemptions_total{mode=recompute}", "jaxtier_requests_swapped",
               "jaxtier_inter_token_latency_seconds_count", "jaxtier_host_kv_cache_bytes"):
    assert name in before
  body = complete(client, prompt=[1, 2, 3], max_tokens=5, temperature=0, ignore_eos=True)
  after = metric_values(client)

  def moved(name):
    return after.get(name, 0) - before.get(name, 0)

  assert moved("jaxtier_generation_tokens_total") == 5 == body["usage"]["completion_tokens"]
  assert moved("jaxtier_prompt_tokens_total") == 3
  assert moved("jaxtier_requests_finished_total{finish_reason=length}") == 1
  assert moved("jaxtier_time_to_first_token_seconds_count") == 1
  assert moved("jaxtier_e2e_request_latency_seconds_count") == 1
  assert moved("jaxtier_inter_token_latency_seconds_count") == 4  # between 5 tokens
  assert after["jaxtier_kv_device_blocks_used"] == 0  # all freed when the request ended
  assert after["jaxtier_kv_device_blocks_total"] == served.engine_config.num_device_blocks
  assert moved("jaxtier_model_steps_total") == 5
  assert after["jaxtier_weight_transfer_bytes_total"] == 0  # nothing offloaded
  assert after["jaxtier_device_weight_bytes"] == checkpoint_bytes() + rotary_bytes(served)


def test_openai_client_against_uvicorn(app, llm):
  with uvicorn_on_localhost(app) as port:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    completion = api.completions.create(model=MODEL, prompt="A tiny model", max_tokens=8,
                                        temperature=0, extra_body=extra)
    assert completion.choices[0].text == llm.generate("A tiny model", greedy(max_tokens=8))[0].text
    messages = [{"role": "user", "content": "hi"}]
    reference = llm.chat(messages, greedy(max_tokens=8))[0]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0, extra_body=extra)
    assert chat.choices[0].message.content == reference.text
    assert chat.usage.completion_tokens == len(reference.token_ids)
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reference.text
    with pytest.raises(openai.NotFoundError):
      api.completions.create(model="other", prompt="x")


@pytest.mark.parametrize("flag, message", [
    ("--offload_tail_layers=some", "offload_tail_layers='some': expected 'auto' or an int >= 0"),
    ("--prefetch_depth=0", "prefetch_depth=0: expected 'auto' or an int in [1, 4]"),
    ("--max_queued_requests=0", "max_queued_requests"),
    ("--shutdown_timeout_s=-1", "shutdown_timeout_s"),
])
def test_serve_rejects_bad_flags_before_loading(flag, message):
  proc = subprocess.run([sys.executable, SERVE, "--model=/nonexistent", flag],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and message in proc.stderr


def test_serve_on_a_port_in_use_exits_at_once_naming_it():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, SERVE, f"--model={fixture_path('tiny_llama')}",
                           f"--port={port}"], capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and f"--port={port}: cannot listen on 127.0.0.1:{port}" in proc.stderr
  assert time.monotonic() - start < 5


def test_sigterm_drains_and_exits_0(tmp_path):
  port = free_port()
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get(
      "JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))}
  proc = subprocess.Popen(
      [sys.executable, SERVE, f"--model={fixture_path('tiny_llama')}", f"--port={port}",
       "--max_model_len=64", "--max_num_seqs=4", "--layer_execution=scan",
       "--shutdown_timeout_s=0"], env=env, stderr=subprocess.PIPE, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    wait_until_healthy(proc, url)
    body = {"prompt": "A tiny model", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
      lines = response.iter_lines()
      first = next(line for line in lines if line)
      proc.send_signal(signal.SIGTERM)
      rest = [line for line in lines if line]
    assert proc.wait(timeout=60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
  chunks = [json.loads(line[len("data: "):]) for line in [first] + rest[:-1]]
  assert rest[-1] == "data: [DONE]"
  assert chunks[-1]["choices"][0]["finish_reason"] in ("abort", "length")
  assert "start-up: " in proc.stderr.read()  # the phases line, printed once ready
