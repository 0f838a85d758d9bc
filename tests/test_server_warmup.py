"""The server's warm-up as an operator sees it: progress in the log and in /metrics, and a failed
warm-up that keeps serving but answers /health with 503 and the reason."""

import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import jaxtier
from conftest import fixture_path
from jaxtier.engine.engine import warmup_programs
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
  keys = warmup_programs(served.engine_config, served.engine.vocab_size)
  engine = AsyncEngine(served)
  try:
    assert engine.wait_ready(timeout_s=300)
    client = TestClient(create_app(engine, MODEL))
    assert client.get("/health").status_code == 200
    values = metric_values(client)
    assert values["jaxtier_ready"] == 1 and values["jaxtier_warmup_failed"] == 0
    assert values["jaxtier_warmup_programs_compiled"] == values["jaxtier_warmup_programs"]
  finally:
    engine.close()
  assert engine.warmup_progress == (len(keys), len(keys))
  assert engine.warmup_report["programs"] == len(keys)
  lines = warmup_lines(caplog)
  assert lines[0].startswith(f"warm-up: 1/{len(keys)} programs") and str(keys[0]) in lines[0]
  assert any(line.startswith(f"warm-up: {len(keys)}/{len(keys)} programs (100%)")
             for line in lines)
  assert lines[-1].startswith(f"warm-up: {len(keys)} programs ready in")


def test_progress_is_logged_at_each_tenth_of_the_programs(served, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  total = 25

  def warmup(progress):
    for done in range(1, total + 1):
      progress(done, total, ("step", done, 16, 8))
    return {"programs": total, "compile_seconds": 0.0}

  served.engine.warmup = warmup
  engine = AsyncEngine(served)
  try:
    assert engine.wait_ready(timeout_s=60)
  finally:
    engine.close()
  logged = [int(line.split()[1].split("/")[0]) for line in warmup_lines(caplog)
            if "/" in line.split()[1]]
  assert logged == [1, 3, 5, 8, 10, 13, 15, 18, 20, 23, 25]  # first, then each tenth


def test_a_failed_warmup_answers_503_with_the_reason_and_still_serves(served, caplog):
  caplog.set_level(logging.INFO, logger="absl")

  def warmup(progress):
    progress(1, 3, ("step", 1, 1, 8))
    raise TypeError("cannot reshape array of shape (24, 16, 48) into shape (-1, 256, 48)")

  served.engine.warmup = warmup
  engine = AsyncEngine(served)
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
    assert (values["jaxtier_warmup_programs_compiled"], values["jaxtier_warmup_programs"]) == (1, 3)
    completion = client.post("/v1/completions", json={"prompt": [5, 17, 42], "max_tokens": 2,
                                                      "temperature": 0, "ignore_eos": True})
    assert completion.status_code == 200, completion.text  # compiled when first needed
    assert client.get("/health").status_code == 503
  finally:
    engine.close()
