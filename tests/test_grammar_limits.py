"""A request's grammar never stalls the others: constraints past the limits are refused before
they are queued (a ValueError, a 400 naming the limit and the field), grammars compile in a worker
while the request waits in the queue, held, and a grammar that fails ends only its own request,
with the reason."""

import asyncio
import json
import random
import statistics
import string
import threading
import time

import httpx
import pytest

import jaxtier
from conftest import fixture_path
from jaxtier import scheduler
from jaxtier.common.grammar_limits import GrammarLimits
from jaxtier.sampling import SamplingParams
from jaxtier.sampling.structured import StructuredOutputsParams, checked_grammar
from server_support import cold_app
from test_engine import assert_all_free, engine_of, prompts_of, tiny  # noqa: F401

CHOICES = ("alpha", "beta", "gamma delta")


def words(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 12)))
          for _ in range(n)]


def nested(depth: int) -> dict:
  schema = {"type": "string"}
  for _ in range(depth):
    schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
  return schema


# The scheduler: a held request keeps its place.

def test_a_held_request_keeps_its_place_while_the_ones_behind_it_start():
  config = scheduler.SchedulerConfig(num_device_blocks=64, num_host_blocks=0, block_size=4,
                                     max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0,
                                     preemption_mode="recompute", victim_policy="longest_waiting",
                                     enable_prefix_caching=False, host_prefix_caching=False)
  state = scheduler.initial_state(config)
  held = scheduler.Request("held", prompt_len=8, max_tokens=4)
  state = scheduler.apply_event(state, scheduler.Arrive(held, held=True))
  state = scheduler.apply_event(state, scheduler.Arrive(scheduler.Request("b", 8, 4)))
  state, plan = scheduler.schedule(state)
  assert plan.prefill.request_ids == ("b",)
  assert [s.request_id for s in state.waiting] == ["held"] and state.held == {"held"}
  state = scheduler.apply_event(state, scheduler.StepFinished(()))
  state = scheduler.apply_event(state, scheduler.Arrive(scheduler.Request("c", 8, 4)))
  state = scheduler.apply_event(state, scheduler.Release("held"))
  state, plan = scheduler.schedule(state)
  assert plan.prefill.request_ids == ("held", "c")  # its place: before the later arrival
  state = scheduler.apply_event(state, scheduler.StepFinished(()))
  state = scheduler.apply_event(state, scheduler.Arrive(scheduler.Request("d", 8, 4), held=True))
  state = scheduler.apply_event(state, scheduler.Abort("d"))
  assert not state.waiting and not state.held


# The limits.

@pytest.mark.parametrize("constraint, field, limit", [
    ({"choice": words(70_000)}, "structured_outputs.choice", "grammar_max_items"),
    ({"choice": ["x" * 1000] * 2000}, "structured_outputs.choice", "grammar_max_bytes"),
    ({"json": {"enum": words(70_000)}}, "structured_outputs.json", "grammar_max_items"),
    ({"json": nested(2000)}, "structured_outputs.json", "grammar_max_depth"),
    ({"regex": "a" * 1_000_001}, "structured_outputs.regex", "grammar_max_bytes"),
])
def test_constraints_past_a_limit_are_refused_at_once_naming_it(constraint, field, limit):
  params = StructuredOutputsParams.of(constraint)
  start = time.perf_counter()
  with pytest.raises(ValueError, match=limit) as info:
    checked_grammar(params, GrammarLimits())
  assert time.perf_counter() - start < 1.0
  assert info.value.field == field and field in str(info.value)
  assert len(str(info.value)) < 300  # the constraint is not echoed


def test_a_choice_of_fifty_thousand_strings_is_under_the_limits():
  checked_grammar(StructuredOutputsParams(choice=words(50_000)), GrammarLimits())
  with pytest.raises(ValueError, match="grammar_max_items=100"):
    checked_grammar(StructuredOutputsParams(choice=words(101)), GrammarLimits(grammar_max_items=100))


# The engine: compiles off its thread.

def slow_compiles(e, release: threading.Event):
  """Makes e's grammar compiles wait for `release` (a slow grammar, under control)."""
  build = e.grammars._build

  def held_build(constraint):
    assert release.wait(timeout=60)
    return build(constraint)

  e.grammars._build = held_build


def test_free_requests_run_while_a_grammar_compiles_and_abort_works_while_it_waits(tiny):
  model, tokenizer = tiny
  e = engine_of(model, tokenizer, max_model_len=128, num_device_blocks=128)
  release = threading.Event()
  slow_compiles(e, release)
  prompts = prompts_of([5, 6, 7])
  constrained = SamplingParams(max_tokens=20, temperature=0.8,
                               structured_outputs={"choice": list(CHOICES)})
  e.add_request("slow", prompts[0], constrained, seed=0)
  e.add_request("gone", prompts[1], constrained, seed=1)
  e.add_request("free", prompts[2], SamplingParams(max_tokens=8, ignore_eos=True), seed=2)
  done = {}
  while "free" not in done:
    for update in e.step():
      if update.completion is not None:
        done[update.request_id] = update.completion
  assert len(done["free"].token_ids) == 8 and "slow" not in done
  assert e.stats()["grammar_compiling"] == 2
  assert e.abort("gone").completion.finish_reason == "abort"
  release.set()
  while e.has_unfinished():
    for update in e.step():
      if update.completion is not None:
        done[update.request_id] = update.completion
  assert done["slow"].text in CHOICES and done["slow"].finish_reason == "stop"
  assert e.stats()["grammar_compiles"] == 1 and not e.stats()["grammar_compiling"]
  assert_all_free(e)


def test_a_grammar_over_its_compile_budget_ends_its_request_with_the_reason(tiny):
  model, tokenizer = tiny
  e = engine_of(model, tokenizer, max_model_len=128, num_device_blocks=128)
  e.grammars.limits = GrammarLimits(grammar_compile_timeout_s=0.2)
  release = threading.Event()
  slow_compiles(e, release)
  e.add_request("r", [5, 6, 7], SamplingParams(structured_outputs={"regex": "a+"}), seed=0)
  start, updates = time.perf_counter(), []
  while e.has_unfinished():
    updates += e.step()
  release.set()
  assert time.perf_counter() - start < 5
  (update,) = updates
  c = update.completion
  assert c.finish_reason == "abort" and c.token_ids == ()
  assert "grammar_compile_timeout_s=0.2" in c.error and "structured_outputs.regex" in c.error
  assert e.stats()["grammar_compile_failures"] == 1
  assert_all_free(e)


# The server.

@pytest.fixture(scope="module")
def app():
  llm = jaxtier.LLM(fixture_path("tiny_llama_chat"), max_model_len=256, max_num_seqs=4,
                    layer_execution="scan")
  with cold_app(llm, "tiny") as app:
    yield app


def post(app, bodies: list[dict], path: str = "/v1/completions") -> list[tuple[float, int, dict]]:
  """Sends the bodies at once; (seconds, status, JSON) of each."""

  async def one(http, body):
    start = time.perf_counter()
    response = await http.post(path, json=body)
    reply = response.text if body.get("stream") else response.json()
    return time.perf_counter() - start, response.status_code, reply

  async def run():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
      return await asyncio.gather(*[one(http, body) for body in bodies])

  return asyncio.run(run())


@pytest.mark.parametrize("constraint, param, limit", [
    ({"choice": words(150_000)}, "structured_outputs.choice", "grammar_max_items"),
    ({"json": {"enum": words(100_000)}}, "structured_outputs.json", "grammar_max_items"),
    ({"json": nested(120)}, "structured_outputs.json", "grammar_max_depth"),
    ({"regex": "(unclosed"}, "structured_outputs.regex", "invalid"),
])
def test_the_server_refuses_constraints_past_a_limit_with_a_400_naming_it(app, constraint, param,
                                                                         limit):
  ((seconds, status, body),) = post(app, [{"prompt": "a b", "max_tokens": 4,
                                          "structured_outputs": constraint}])
  assert status == 400, body
  assert body["error"]["param"] == param and limit in body["error"]["message"]
  assert seconds < 1.0


def test_a_body_nested_past_what_json_reads_is_a_400_naming_the_depth_limit(app):
  schema = '{"properties": ' * 3000 + "{}" + "}" * 3000
  body = '{"prompt": "a", "structured_outputs": {"json": ' + schema + "}}"

  async def run():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
      return await http.post("/v1/completions", content=body,
                             headers={"content-type": "application/json"})

  response = asyncio.run(run())
  assert response.status_code == 400
  error = response.json()["error"]
  assert "grammar_max_depth=100" in error["message"]
  assert error["param"] == "structured_outputs.json"


def test_a_big_choice_does_not_stall_a_plain_stream(app):
  # Long enough that the big request's fixed costs (reading a 500 kB body on the event loop) are
  # not most of the plain one's time. The control is the same pair with a small choice (the same
  # batch), rounds interleaved and medians compared, so a loaded machine slows both alike.
  plain = {"prompt": "a b c", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
           "stream": True}
  big = {"prompt": "d e", "max_tokens": 30, "structured_outputs": {"choice": words(50_000)}}
  small = {**big, "structured_outputs": {"choice": list(CHOICES)}}
  post(app, [plain, small])  # compiles
  with_small, with_big = [], []
  for _ in range(3):
    with_small.append(post(app, [plain, small])[0][0])
    (seconds, status, _), (_, big_status, reply) = post(app, [plain, big])
    assert status == 200 and big_status == 200, reply
    assert reply["choices"][0]["text"] in big["structured_outputs"]["choice"]
    with_big.append(seconds)
  assert statistics.median(with_big) <= 3 * statistics.median(with_small), (with_big, with_small)
