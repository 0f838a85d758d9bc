"""Chat templates where `transformers` keeps them, and the `chat_template` engine argument.

`tests/fixtures/tiny_llama_chat` is a directory as `save_pretrained` writes it today (the template
in `chat_template.jinja`, none in tokenizer_config.json), with HF's greedy generation from
chat-templated prompts (`scripts/make_hf_fixtures.py --only_chat_template`).
"""

import json
import os
import shutil

import pytest

import jaxtier
from jaxtier.engine.args import EngineArgs
from jaxtier.text.tokenizer import load_tokenizer_dir, resolve_chat_template
from conftest import fixture_path

CHAT_DIR = fixture_path("tiny_llama_chat")
with open(os.path.join(CHAT_DIR, "hf_chat.json")) as _f:
  HF_CHAT = json.load(_f)
CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_llm():
  return jaxtier.LLM(CHAT_DIR, max_model_len=128, max_num_seqs=4)


def test_fixture_keeps_the_template_in_its_own_file():
  with open(os.path.join(CHAT_DIR, "tokenizer_config.json")) as f:
    assert "chat_template" not in json.load(f)
  assert os.path.isfile(os.path.join(CHAT_DIR, "chat_template.jinja"))


def test_chat_renders_and_generates_as_hugging_face(chat_llm):
  for case in HF_CHAT["cases"]:
    assert chat_llm.tokenizer.apply_chat_template(case["messages"]) == case["text"]
    assert chat_llm.chat_token_ids(case["messages"]) == case["ids"]
  params = jaxtier.SamplingParams(max_tokens=HF_CHAT["max_new_tokens"], temperature=0)
  outs = chat_llm.chat([case["messages"] for case in HF_CHAT["cases"]], params)
  for out, case in zip(outs, HF_CHAT["cases"]):
    assert list(out.prompt_token_ids) == case["ids"]
    assert list(out.token_ids) == case["greedy"]


def _tokenizer_dir(tmp_path, config: dict, files: dict[str, str]) -> str:
  """A copy of the fixture's tokenizer with `config` as tokenizer_config.json plus `files`."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  shutil.copy(os.path.join(CHAT_DIR, "tokenizer.json"), tmp_path)
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", **config}, f)
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  return str(tmp_path)


def _template(directory: str) -> str | None:
  return load_tokenizer_dir(directory).chat_template


def test_template_sources_in_transformers_order(tmp_path):
  legacy = json.dumps({"chat_template": "json"})
  assert _template(_tokenizer_dir(tmp_path, {"chat_template": "config"},
                                  {"chat_template.jinja": "jinja",
                                   "chat_template.json": legacy})) == "jinja"
  os.remove(tmp_path / "chat_template.jinja")
  assert _template(str(tmp_path)) == "json"
  os.remove(tmp_path / "chat_template.json")
  assert _template(str(tmp_path)) == "config"


def test_named_templates_use_the_default(tmp_path):
  named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
  assert _template(_tokenizer_dir(tmp_path / "list", {"chat_template": named}, {})) == "plain"
  assert _template(_tokenizer_dir(
      tmp_path / "dict", {}, {"chat_template.json": json.dumps(
          {"chat_template": {"default": "plain", "rag": "rag"}})})) == "plain"
  assert _template(_tokenizer_dir(tmp_path / "none", {"chat_template": named[:1]}, {})) is None


def test_resolve_chat_template_reads_files_and_strings(tmp_path):
  path = tmp_path / "t.jinja"
  path.write_text("{{ messages[0]['content'] }}")
  assert resolve_chat_template(str(path)) == "{{ messages[0]['content'] }}"
  assert resolve_chat_template("{{ bos_token }}") == "{{ bos_token }}"
  with pytest.raises(ValueError, match="looks like a file path"):
    resolve_chat_template(str(tmp_path / "missing.jinja"))
  with pytest.raises(ValueError, match="does not parse"):
    resolve_chat_template("{% for m in messages %}")
  with pytest.raises(ValueError, match="chat_template"):
    EngineArgs(chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_argument_overrides_the_models(tmp_path):
  path = tmp_path / "echo.jinja"
  path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  for value in (str(path), path.read_text()):
    llm = jaxtier.LLM(CHAT_DIR, max_model_len=64, max_num_seqs=2, chat_template=value)
    assert llm.tokenizer.apply_chat_template(CONVERSATION) == "hi"
    assert llm.chat_token_ids(CONVERSATION) == llm.tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_flag_reaches_llm_kwargs(tmp_path):
  from absl import flags
  from jaxtier.engine import flags as engine_flags
  path = tmp_path / "echo.jinja"
  path.write_text("{{ messages[0]['content'] }}")
  saved = flags.FLAGS["chat_template"].value
  try:
    flags.FLAGS(["prog", f"--chat_template={path}"], known_only=True)
    assert engine_flags.llm_kwargs()["chat_template"] == str(path)
  finally:
    flags.FLAGS["chat_template"].value = saved
