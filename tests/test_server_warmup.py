"""The server's warm-up as an operator sees it: progress in the log and in /metrics, and a failed
warm-up that keeps serving but answers /health with 503 and the reason."""

import logging
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import jaxtier
from conftest import fixture_path
from jaxtier.engine import engine as engine_module
from jaxtier.engine.engine import ready_programs, warmup_programs
from jaxtier.server import AsyncEngine, create_app

MODEL = "tiny"
ENGINE_ARGS = dict(max_model_len=16, max_num_seqs=1, num_device_blocks=8, num_host_blocks=0,
                   layer_execution="scan")


def metric_values(client) -> dict[str, float]:
  text = client.get("/metrics").text
  return {s.name: s.value for family in text_string_to_metric_families(text)
          for s in family.samples}


def warmup_lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up")]


@pytest.fixture
def served():
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


def test_warmup_logs_progress_with_each_program_compiled(served, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  vocab = served.engine.grammar_vocab
  keys = warmup_programs(served.engine_config, vocab)
  ready = ready_programs(served.engine_config, vocab)
  assert ready and set(ready) < set(keys)
  engine = AsyncEngine(served)
  try:
    assert engine.wait_ready(timeout_s=300)
    assert set(ready) <= {key for key in keys if served.engine.runner.has_program(key)}
    assert engine.wait_warm(timeout_s=300)
    client = TestClient(create_app(engine, MODEL))
    assert client.get("/health").status_code == 200
    values = metric_values(client)
    assert values["jaxtier_ready"] == 1 and values["jaxtier_warmup_failed"] == 0
    assert (values["jaxtier_warmup_programs_compiled"] == values["jaxtier_warmup_programs"]
            == len(keys))
  finally:
    engine.close()
  assert engine.warmup_progress == (len(keys), len(keys))
  assert engine.warmup_report["programs"] == len(keys)
  lines = warmup_lines(caplog)
  assert lines[0].startswith(f"warm-up: 1/{len(keys)} programs") and str(keys[0]) in lines[0]
  # ready once an ordinary request's programs exist (they come first), before the others
  ready_count = max(keys.index(key) for key in ready) + 1
  at_ready = [i for i, line in enumerate(lines)
              if line.startswith(f"warm-up: ready ({ready_count} programs")]
  assert len(at_ready) == 1 and ready_count < len(keys)
  assert any(line.startswith(f"warm-up: {len(keys)}/{len(keys)} programs (100%)")
             for line in lines[at_ready[0]:])
  assert lines[-1].startswith(f"warm-up: {len(keys)} programs ready in")


def fake_compile(served, started: threading.Event, fail_after: int | None = None):
  """Stands in for `Engine.compile_programs` under the warm-up thread: reports each program
  compiled without compiling it (up to `fail_after`, then raises), once `started` is set.

  `started` is set once `AsyncEngine(...)` has returned: its progress callback reads the
  server's `warmup`, which a thread reporting at once would find unset."""
  def compile_programs(keys, progress):
    assert started.wait(60)
    for done, key in enumerate(keys, 1):
      progress(done, len(keys), key)
      if done == fail_after:
        raise TypeError("cannot reshape array of shape (24, 16, 48) into shape (-1, 256, 48)")
  served.engine.compile_programs = compile_programs


def test_progress_is_logged_at_each_tenth_of_the_programs(served, caplog, monkeypatch):
  caplog.set_level(logging.INFO, logger="absl")
  total = 25
  monkeypatch.setattr(engine_module, "warmup_programs", lambda config, vocab: [
      ("step", done, 16, 8) for done in range(1, total + 1)])
  started = threading.Event()
  fake_compile(served, started)
  engine = AsyncEngine(served)
  started.set()
  try:
    assert engine.wait_warm(timeout_s=60)
    assert engine.warmup_progress == (total, total)
  finally:
    engine.close()
  logged = [int(line.split()[1].split("/")[0]) for line in warmup_lines(caplog)
            if "/" in line.split()[1]]
  assert logged == [1, 3, 5, 8, 10, 13, 15, 18, 20, 23, 25]  # first, then each tenth


def test_a_failed_warmup_answers_503_with_the_reason_and_still_serves(served, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  keys = warmup_programs(served.engine_config, served.engine.grammar_vocab)
  ready = ready_programs(served.engine_config, served.engine.grammar_vocab)
  assert keys.index(ready[-1]) > 0  # failing at the first program, it is never ready
  started = threading.Event()
  fake_compile(served, started, fail_after=1)
  engine = AsyncEngine(served)
  started.set()
  try:
    assert not engine.wait_ready(timeout_s=60)
    client = TestClient(create_app(engine, MODEL))
    response = client.get("/health")
    assert response.status_code == 503
    reason = "TypeError: cannot reshape array of shape (24, 16, 48) into shape (-1, 256, 48)"
    assert response.json() == {"status": "warm-up failed", "error": reason}
    assert any(reason in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    values = metric_values(client)
    assert values["jaxtier_ready"] == 0 and values["jaxtier_warmup_failed"] == 1
    assert (values["jaxtier_warmup_programs_compiled"], values["jaxtier_warmup_programs"]) == (
        1, len(keys))
    completion = client.post("/v1/completions", json={"prompt": [5, 17, 42], "max_tokens": 2,
                                                      "temperature": 0, "ignore_eos": True})
    assert completion.status_code == 200, completion.text  # compiled when first needed
    assert client.get("/health").status_code == 503
  finally:
    engine.close()
