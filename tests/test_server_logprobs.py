"""Log-probabilities over HTTP (completions `logprobs`/`echo`, chat `logprobs`/`top_logprobs`)
against the offline API's (`SamplingParams(logprobs=..., prompt_logprobs=...)`) on a second LLM."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from server_support import uvicorn_on_localhost, warm_engine
from jaxtier.server import create_app

MODEL = "tiny"
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, layer_execution="scan")
TOL = 1e-4
CHAT = [{"role": "user", "content": "hi"}]


def greedy(**kwargs) -> jaxtier.SamplingParams:
  return jaxtier.SamplingParams(**{"temperature": 0, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def llm():
  """The offline reference (an engine of its own: the server's is stepped by its thread)."""
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def engine():
  with warm_engine(jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)) as engine:
    yield engine


@pytest.fixture(scope="module")
def app(engine):
  return create_app(engine, MODEL)


@pytest.fixture(scope="module")
def client(app):
  return TestClient(app)


def post(client, path: str, **body) -> dict:
  response = client.post(path, json={"model": MODEL, **body})
  assert response.status_code == 200, response.text
  return response.json()


def events(client, path: str, **body) -> list[dict]:
  """The JSON chunks of a streamed response (without [DONE])."""
  with client.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as response:
    assert response.status_code == 200
    lines = [line for line in response.iter_lines() if line]
  assert lines[-1] == "data: [DONE]"
  return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def text_values(entry) -> dict[str, float]:
  """{text: log-probability} of an offline entry (a text of several tokens keeps the best)."""
  out: dict[str, float] = {}
  for value in entry.values():
    out[value.decoded_token] = max(out.get(value.decoded_token, -1e9), value.logprob)
  return out


def check_legacy(got: dict, token_ids, entries, tokenizer):
  """The legacy logprobs lists of a choice against offline entries (None: a first prompt token)."""
  assert len(got["tokens"]) == len(got["token_logprobs"]) == len(got["top_logprobs"]) == len(
      got["text_offset"]) == len(token_ids)
  for j, (token, entry) in enumerate(zip(token_ids, entries)):
    assert got["tokens"][j] == tokenizer.decode([token], skip_special_tokens=False)
    if entry is None:
      assert got["token_logprobs"][j] is None and got["top_logprobs"][j] is None
      continue
    assert got["token_logprobs"][j] == pytest.approx(entry[token].logprob, abs=TOL)
    expected = text_values(entry)
    assert got["top_logprobs"][j].keys() == expected.keys()
    for text, value in expected.items():
      assert got["top_logprobs"][j][text] == pytest.approx(value, abs=TOL)


def check_chat(got: dict, token_ids, entries, top: int):
  """The chat logprobs content of a choice against offline entries and their `top` best tokens."""
  assert len(got["content"]) == len(token_ids)
  for item, token, entry in zip(got["content"], token_ids, entries):
    text = entry[token].decoded_token
    assert item["token"] == text and item["bytes"] == list(text.encode("utf-8"))
    assert item["logprob"] == pytest.approx(entry[token].logprob, abs=TOL)
    best = sorted(entry.values(), key=lambda v: v.rank)[:top]
    assert [t["token"] for t in item["top_logprobs"]] == [v.decoded_token for v in best]
    assert [t["bytes"] for t in item["top_logprobs"]] == [
        list(v.decoded_token.encode("utf-8")) for v in best]
    assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx(
        [v.logprob for v in best], abs=TOL)


def joined(chunks: list[dict], index: int = 0) -> dict[str, list]:
  """The legacy logprobs lists of one choice's chunks, concatenated."""
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for chunk in chunks:
    for choice in chunk["choices"]:
      if choice["index"] == index:
        for key in out:
          out[key] += choice["logprobs"][key]
  return out


def streamed_text(chunks: list[dict], index: int = 0) -> str:
  return "".join(c["text"] for chunk in chunks for c in chunk["choices"] if c["index"] == index)


def test_completion_logprobs_equal_the_offline_ones(client, llm):
  prompts = ["A tiny model", "Once upon a time"]
  body = post(client, "/v1/completions", prompt=prompts, max_tokens=8, temperature=0,
              ignore_eos=True, logprobs=3)
  reference = llm.generate(prompts, greedy(max_tokens=8, logprobs=3))
  for choice, out in zip(body["choices"], reference):
    c = out.outputs[0]
    assert choice["text"] == c.text
    check_legacy(choice["logprobs"], c.token_ids, c.logprobs, llm.tokenizer)
  greedy_text = body["choices"][0]  # whole ASCII characters: each token's text follows the last
  tokens, offsets = greedy_text["logprobs"]["tokens"], greedy_text["logprobs"]["text_offset"]
  assert "".join(tokens) == greedy_text["text"]
  assert offsets == [len("".join(tokens[:j])) for j in range(len(tokens))]


def test_sampled_completion_logprobs_equal_the_offline_ones(client, llm):
  body = post(client, "/v1/completions", prompt="Hello", max_tokens=10, temperature=0.9,
              seed=5, n=2, logprobs=0)
  reference = llm.generate(["Hello"] * 2, [
      jaxtier.SamplingParams(max_tokens=10, temperature=0.9, seed=s, logprobs=0) for s in (5, 6)])
  for choice, out in zip(body["choices"], reference):
    c = out.outputs[0]
    assert choice["text"] == c.text
    check_legacy(choice["logprobs"], c.token_ids, c.logprobs, llm.tokenizer)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # the sampled token
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])


@pytest.mark.parametrize("prompts", [["A tiny model", "Hi there"], [[5, 17, 42, 9]]])
def test_echo_returns_the_prompt_first_with_an_entry_per_prompt_token(client, llm, prompts):
  body = post(client, "/v1/completions", prompt=prompts, max_tokens=5, temperature=0,
              ignore_eos=True, logprobs=2, echo=True)
  reference = llm.generate(prompts, greedy(max_tokens=5, logprobs=2, prompt_logprobs=2))
  prompt_texts = [p if isinstance(p, str) else llm.tokenizer.decode(p) for p in prompts]
  for choice, out, prompt in zip(body["choices"], reference, prompt_texts):
    c = out.outputs[0]
    assert choice["text"] == prompt + c.text
    ids = list(out.prompt_token_ids) + list(c.token_ids)
    check_legacy(choice["logprobs"], ids, list(out.prompt_logprobs) + list(c.logprobs),
                 llm.tokenizer)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets[len(out.prompt_token_ids)] == len(prompt)
  prompt_tokens = body["choices"][0]["logprobs"]["tokens"][:len(reference[0].prompt_token_ids)]
  assert "".join(prompt_tokens) == prompt_texts[0]
  plain = post(client, "/v1/completions", prompt=prompts, max_tokens=5, temperature=0,
               ignore_eos=True, echo=True)
  assert [c["text"] for c in plain["choices"]] == [
      p + out.outputs[0].text for p, out in zip(prompt_texts, reference)]
  assert all(c["logprobs"] is None for c in plain["choices"])


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt(client, llm, stream):
  prompt = "Once upon a time"
  request = dict(prompt=prompt, max_tokens=0, echo=True, logprobs=3)
  out = llm.generate(prompt, jaxtier.SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
  n = len(out.prompt_token_ids)
  if stream:
    chunks = events(client, "/v1/completions", **request,
                    stream_options={"include_usage": True})
    text, logprobs, usage = streamed_text(chunks), joined(chunks[:-1]), chunks[-1]["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
  else:
    body = post(client, "/v1/completions", **request)
    choice, usage = body["choices"][0], body["usage"]
    text, logprobs = choice["text"], choice["logprobs"]
    assert choice["finish_reason"] == "length"
  assert text == prompt
  check_legacy(logprobs, out.prompt_token_ids, out.prompt_logprobs, llm.tokenizer)
  assert usage == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_equal_the_offline_ones(client, llm):
  body = post(client, "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0.8,
              seed=11, logprobs=True, top_logprobs=3)
  c = llm.chat(CHAT, jaxtier.SamplingParams(max_tokens=6, temperature=0.8, seed=11,
                                            logprobs=3))[0].outputs[0]
  assert body["choices"][0]["message"]["content"] == c.text
  check_chat(body["choices"][0]["logprobs"], c.token_ids, c.logprobs, 3)
  plain = post(client, "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0.8,
               seed=11, logprobs=True)
  check_chat(plain["choices"][0]["logprobs"], c.token_ids, c.logprobs, 0)
  assert all(item["top_logprobs"] == [] for item in plain["choices"][0]["logprobs"]["content"])
  off = post(client, "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0.8,
             seed=11)
  assert off["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("request_", [
    dict(prompt="A tiny model", max_tokens=20, temperature=0, ignore_eos=True, logprobs=2,
         stop=["Z23"]),
    dict(prompt="A tiny model", max_tokens=8, temperature=0, ignore_eos=True, logprobs=1,
         echo=True),
    dict(prompt="Hello", max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=2),
], ids=["stop", "echo", "sampled"])
def test_streamed_completion_logprobs_concatenate_to_the_whole_ones(client, request_):
  whole = post(client, "/v1/completions", **request_)
  chunks = events(client, "/v1/completions", **request_)
  for choice in whole["choices"]:
    i = choice["index"]
    assert streamed_text(chunks, i) == choice["text"]
    assert joined(chunks, i) == choice["logprobs"]
    sent = 0
    for c in (c for chunk in chunks for c in chunk["choices"] if c["index"] == i):
      sent += len(c["text"])  # a chunk's tokens start within the text sent up to its end
      assert all(offset <= sent for offset in c["logprobs"]["text_offset"])
  if request_.get("echo"):
    first = chunks[0]["choices"][0]
    assert first["text"] == request_["prompt"]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == whole["usage"]["prompt_tokens"]
  if request_.get("stop"):
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert len(whole["choices"][0]["logprobs"]["tokens"]) == whole["usage"]["completion_tokens"]


def test_streamed_chat_logprobs_concatenate_to_the_whole_ones(client):
  request = dict(messages=CHAT, max_tokens=10, temperature=1.0, seed=2, logprobs=True,
                 top_logprobs=2)
  whole = post(client, "/v1/chat/completions", **request)["choices"][0]
  chunks = events(client, "/v1/chat/completions", **request)
  assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
  content = [item for chunk in chunks[1:] for item in chunk["choices"][0]["logprobs"]["content"]]
  assert content == whole["logprobs"]["content"]
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == (
      whole["message"]["content"])


def test_openai_client_parses_logprobs(app, llm):
  with uvicorn_on_localhost(app) as port:
    url = f"http://127.0.0.1:{port}/v1"
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    out = llm.generate("A tiny model", greedy(max_tokens=6, logprobs=2, prompt_logprobs=2))[0]
    completion = api.completions.create(model=MODEL, prompt="A tiny model", max_tokens=6,
                                        temperature=0, logprobs=2, echo=True, extra_body=extra)
    logprobs = completion.choices[0].logprobs
    n = len(out.prompt_token_ids)
    assert completion.choices[0].text == "A tiny model" + out.outputs[0].text
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == n + 6
    assert logprobs.token_logprobs[n:] == pytest.approx(
        [e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
        abs=TOL)
    assert logprobs.text_offset[n] == len("A tiny model")
    chat_ref = llm.chat(CHAT, greedy(max_tokens=6, logprobs=2))[0].outputs[0]
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [
        e[t].decoded_token for t, e in zip(chat_ref.token_ids, chat_ref.logprobs)]
    assert all(len(c.top_logprobs) == 2 and isinstance(c.top_logprobs[0].bytes, list)
               for c in content)
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, stream=True,
                                         extra_body=extra)
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
