"""Records of the batch job (`scripts/batch_infer.py`), checked by the rules of the HTTP server.

A record is one JSON object per line: `{"id", "prompt"}` or `{"id", "messages"}`, optionally with
a constraint on its output: vLLM's `structured_outputs` or OpenAI's `response_format`, as the
server takes them (a bad schema, regex or grammar rejects the record). An id is a
non-empty string or an integer. A prompt is a non-empty string or a non-empty list of token ids
(integers >= 0; booleans are not integers here). Messages are the server's `ChatMessage`s, so a
record's messages are accepted exactly when `/v1/chat/completions` would accept them. Unknown
fields are rejected, as in the server's request bodies. Checks that need the tokenizer (vocabulary,
context window, chat template) belong to `LLM.prompt_token_ids` and `LLM.chat_token_ids`.
"""

import json
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxtier.sampling.samplers import SamplingParamError, SamplingParams
from jaxtier.sampling.structured import StructuredOutputsError
from jaxtier.server.protocol import ChatMessage, ResponseFormat, error_messages

_JSON_TYPE_NAMES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
                    str: "a string", list: "a list", dict: "an object"}


def _json_type(value: Any) -> str:
  return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


class BatchRecord(BaseModel):
  """One input line of the batch job."""
  model_config = ConfigDict(extra="forbid", frozen=True)
  id: str | int
  prompt: Any = None
  messages: list[ChatMessage] = Field(None, min_length=1)
  structured_outputs: dict | None = None
  response_format: ResponseFormat | None = None

  @pydantic.model_validator(mode="before")
  @classmethod
  def _object_with_id(cls, value: Any) -> Any:
    if not isinstance(value, dict) or "id" not in value:
      raise ValueError("expected an object with an 'id'")
    return value

  @pydantic.field_validator("id", mode="before")
  @classmethod
  def _id(cls, value: Any) -> str | int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
      raise ValueError(f"expected a string or an integer, got {_json_type(value)}")
    if value == "":
      raise ValueError("is an empty string")
    return value

  @pydantic.field_validator("prompt")
  @classmethod
  def _prompt(cls, value: Any) -> str | list[int]:
    if isinstance(value, str):
      if not value:
        raise ValueError("is an empty string")
      return value
    if isinstance(value, list):
      if not value:
        raise ValueError("is an empty list")
      bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int) or t < 0]
      if bad:
        raise ValueError(f"token ids must be integers >= 0, got {json.dumps(bad[:5])}")
      return value
    raise ValueError("expected a non-empty string or a non-empty list of token ids, got "
                     f"{_json_type(value)}")

  @pydantic.model_validator(mode="after")
  def _one_input(self) -> "BatchRecord":
    if ("prompt" in self.model_fields_set) == ("messages" in self.model_fields_set):
      raise ValueError("expected exactly one of 'prompt' or 'messages'")
    return self

  @pydantic.model_validator(mode="after")
  def _constraint(self) -> "BatchRecord":
    if self.structured_outputs is not None and self.response_format is not None:
      raise ValueError("expected at most one of 'structured_outputs' or 'response_format'")
    try:
      constraint = SamplingParams(structured_outputs=self.constraint()).structured_outputs
      if constraint is not None:  # checked now (the default limits), so the record is refused
        constraint.llguidance_grammar()
    except (SamplingParamError, StructuredOutputsError) as e:
      raise ValueError(str(e)) from None
    return self

  def constraint(self) -> dict | None:
    """The record's `SamplingParams.structured_outputs` (None: unconstrained)."""
    if self.response_format is not None:
      return self.response_format.structured_outputs()
    return self.structured_outputs

  @property
  def key(self) -> str:
    """The id as compared between records and against the output file (1 and "1" are the same)."""
    return str(self.id)

  def conversation(self) -> list[dict[str, str]] | None:
    """The messages as the chat template takes them, or None for a prompt record."""
    if self.messages is None:
      return None
    return [m.as_dict() for m in self.messages]

  def engine_input(self) -> str | list[int] | list[dict[str, str]]:
    """What `LLM.generate_stream` takes: the prompt or the conversation."""
    return self.prompt if self.messages is None else self.conversation()


def _describe(error: pydantic.ValidationError) -> str:
  """'field: problem; ...' in the wording of the server's 400 responses."""
  return "; ".join(message for message, _ in error_messages(error.errors()))


def parse_record(line: str) -> BatchRecord:
  """The record on one input line; ValueError saying what is wrong with it."""
  try:
    value = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON ({e.msg})") from None
  try:
    return BatchRecord.model_validate(value)
  except pydantic.ValidationError as e:
    raise ValueError(_describe(e)) from None
