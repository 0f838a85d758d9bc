"""The OpenAI-compatible server on the tiny Llama, against `jaxtier.LLM` as the reference."""

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import jaxtier
from conftest import fixture_path
from jaxtier.server import AsyncEngine, EngineError, create_app
from jaxtier.server.detokenize import IncrementalDetokenizer, stop_prefix_len

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
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def engine(llm):
  engine = AsyncEngine(llm)
  yield engine
  engine.close()


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
  assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                           "total_tokens": prompt_tokens + generated}


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
           "total_tokens": prompt_tokens + 16}
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
  engine = AsyncEngine(offloaded)
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
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs is not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo is not supported"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of=3 is not supported"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 0.1}, 400, "min_p is not a supported field"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
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
     "tools and tool_choice are not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400,
     "response_format type 'json_object' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
     400, "logprobs and top_logprobs are not supported"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_bad_input_gets_an_openai_error(client, path, body, status, message):
  response = client.post(path, json=body)
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


class RecordingDriver:
  """An `LLM` whose batches are recorded, and which fails any batch holding `FAIL_PROMPT`."""
  FAIL_PROMPT = (7, 7, 7)

  def __init__(self, llm):
    self.llm, self.max_num_seqs, self.batches = llm, llm.max_num_seqs, []

  def __getattr__(self, name):
    return getattr(self.llm, name)

  def run_batch(self, requests, on_step=None, aborted=None):
    if any(r.prompt_token_ids == self.FAIL_PROMPT for r in requests):
      raise RuntimeError("injected failure")
    self.batches.append(self.llm.run_batch(requests, on_step=on_step, aborted=aborted))
    return self.batches[-1]


class HeldDriver(RecordingDriver):
  """A `RecordingDriver` whose batches stop after their first step until `release` is set, so a
  test can queue and abort requests mid-batch however fast the model runs."""

  def __init__(self, llm):
    super().__init__(llm)
    self.release = threading.Event()

  def run_batch(self, requests, on_step=None, aborted=None):
    def held_on_step(updates):
      on_step(updates)
      assert self.release.wait(timeout=60), "the test never released the batch"
    return super().run_batch(requests, on_step=held_on_step, aborted=aborted)


def test_abort_releases_the_row_and_drops_queued_requests(llm):
  driver = HeldDriver(llm)
  engine = AsyncEngine(driver)
  ids = llm.prompt_token_ids("A tiny model")

  async def scenario():
    running = engine.generate(llm.make_request(ids, greedy(max_tokens=40)))
    first = await anext(running)
    waiting = asyncio.ensure_future(anext(engine.generate(llm.make_request(ids, greedy()))))
    while engine.stats().waiting == 0:
      await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert engine.stats().waiting == 0
    await running.aclose()
    driver.release.set()
    return first, [u async for u in engine.generate(llm.make_request(ids, greedy(max_tokens=3)))]

  try:
    first, after = asyncio.run(scenario())
  finally:
    driver.release.set()
    engine.close()
  aborted, = driver.batches[0]
  assert aborted.finish_reason == "abort" and 1 <= len(aborted.token_ids) < 40
  unaborted = llm.generate("A tiny model", greedy(max_tokens=40))[0].token_ids
  assert aborted.token_ids == unaborted[:len(aborted.token_ids)]
  assert first.new_token_ids == unaborted[:len(first.new_token_ids)]
  assert len(driver.batches) == 2  # the cancelled queued request never ran
  assert after[-1].completion.token_ids == llm.generate("A tiny model",
                                                        greedy(max_tokens=3))[0].token_ids
  assert engine.stats().running == 0


def test_requests_sent_together_share_one_batch(llm):
  driver = RecordingDriver(llm)
  engine = AsyncEngine(driver, batch_wait_s=30.0)  # a full batch must not wait for it
  requests = [llm.make_request(llm.prompt_token_ids(f"prompt {i}"), greedy(max_tokens=2))
              for i in range(llm.max_num_seqs)]

  async def collect(request):
    return [u async for u in engine.generate(request)][-1].completion

  async def scenario():
    return await asyncio.gather(*(collect(r) for r in requests))

  start = time.monotonic()
  try:
    completions = asyncio.run(scenario())
  finally:
    engine.close()
  assert time.monotonic() - start < 30
  assert [len(batch) for batch in driver.batches] == [llm.max_num_seqs]
  reference = llm.generate([f"prompt {i}" for i in range(llm.max_num_seqs)], greedy(max_tokens=2))
  assert [c.token_ids for c in completions] == [o.token_ids for o in reference]


def test_a_failing_batch_is_an_error_and_the_engine_keeps_serving(llm):
  engine = AsyncEngine(RecordingDriver(llm))
  try:
    failing = TestClient(create_app(engine, MODEL))
    response = failing.post("/v1/completions", json={"prompt": list(RecordingDriver.FAIL_PROMPT)})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "injected failure" in response.json()["error"]["message"]
    with failing.stream("POST", "/v1/completions",
                        json={"prompt": list(RecordingDriver.FAIL_PROMPT), "stream": True}) as r:
      assert "injected failure" in events(r)[-1]["error"]["message"]
    body = complete(failing, prompt="Hi", max_tokens=3, temperature=0, ignore_eos=True)
    assert body["choices"][0]["text"] == llm.generate("Hi", greedy(max_tokens=3))[0].text
  finally:
    engine.close()
  with pytest.raises(EngineError, match="shut down"):
    asyncio.run(anext(engine.generate(llm.make_request([1, 2], greedy()))))


def test_metrics_count_requests_and_tokens(client, llm):
  before = metric_values(client)
  for name in ("jaxtier_requests_running", "jaxtier_requests_waiting",
               "jaxtier_weight_transfer_bytes_total", "jaxtier_device_weight_bytes",
               "jaxtier_host_weight_bytes", "jaxtier_time_to_first_token_seconds_count",
               "jaxtier_e2e_request_latency_seconds_count"):
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
  assert moved("jaxtier_model_steps_total") == 5
  assert after["jaxtier_weight_transfer_bytes_total"] == 0  # nothing offloaded
  assert after["jaxtier_device_weight_bytes"] == checkpoint_bytes() + rotary_bytes(llm)


def test_openai_client_against_uvicorn(app, llm):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not server.started:
      assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
      time.sleep(0.05)
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
  finally:
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize("flag, message", [
    ("--offload_tail_layers=some", "offload_tail_layers='some': expected 'auto' or an int >= 0"),
    ("--prefetch_depth=0", "prefetch_depth=0: expected 'auto' or an int in [1, 4]"),
])
def test_serve_rejects_bad_flags_before_loading(flag, message):
  proc = subprocess.run([sys.executable, SERVE, "--model=/nonexistent", flag],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and message in proc.stderr
