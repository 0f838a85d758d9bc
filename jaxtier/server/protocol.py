"""Request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`) and their mapping
onto `SamplingParams`.

Unknown fields are rejected, and so are known fields whose meaning the engine does not implement
(logprobs, echo, penalties, tools, ...): a request is either served as asked or answered with 400.
"""

from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxtier.sampling import SamplingParams

TokenIds = list[int]


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: bool = False


class _SamplingRequest(BaseModel):
  """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""
  model_config = ConfigDict(extra="forbid")
  model: str | None = None  # None: the served model
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  n: int = Field(1, ge=1, le=128)
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None

  def _check_shared(self) -> None:
    if self.frequency_penalty or self.presence_penalty:
      raise ValueError("frequency_penalty and presence_penalty are not supported; send 0")
    if self.logit_bias:
      raise ValueError("logit_bias is not supported")
    if self.stream_options is not None and not self.stream:
      raise ValueError("stream_options is only allowed together with stream=true")

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage

  def sampling_params(self, max_tokens: int) -> list[SamplingParams]:
    """One `SamplingParams` per choice; choice j of a seeded request uses seed + j.

    Raises ValueError (from `SamplingParams`) for out-of-range values.
    """
    return [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k,
                           seed=None if self.seed is None else (self.seed + j) % 2**32,
                           stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                           ignore_eos=self.ignore_eos)
            for j in range(self.n)]


class CompletionRequest(_SamplingRequest):
  """Body of `POST /v1/completions`."""
  prompt: str | list[str] | TokenIds | list[TokenIds]
  max_tokens: int | None = 16
  best_of: int | None = None
  echo: bool = False
  logprobs: int | None = None
  suffix: str | None = None

  @pydantic.field_validator("prompt", mode="wrap")
  @classmethod
  def _prompt_shape(cls, value, handler):
    try:
      return handler(value)
    except pydantic.ValidationError:
      raise ValueError("expected a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids") from None

  @pydantic.model_validator(mode="after")
  def _supported(self) -> "CompletionRequest":
    self._check_shared()
    if self.logprobs is not None:
      raise ValueError("logprobs is not supported")
    if self.echo:
      raise ValueError("echo is not supported")
    if self.suffix:
      raise ValueError("suffix is not supported")
    if self.best_of is not None and self.best_of != self.n:
      raise ValueError(f"best_of={self.best_of} is not supported; only best_of equal to n "
                       f"(n={self.n}) is")
    if isinstance(self.prompt, list) and not self.prompt:
      raise ValueError("prompt is an empty list")
    return self

  def prompts(self) -> list[str | TokenIds]:
    """The prompts of this request: a string, token ids, or a list of either."""
    if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
      return [self.prompt]
    return list(self.prompt)


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="forbid")
  role: Literal["system", "developer", "user", "assistant"]
  content: str | list[TextPart]

  def as_dict(self) -> dict[str, str]:
    """The message as the chat template takes it (text parts joined)."""
    text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
    return {"role": self.role, "content": text}


class ResponseFormat(BaseModel):
  model_config = ConfigDict(extra="allow")
  type: str


class ChatCompletionRequest(_SamplingRequest):
  """Body of `POST /v1/chat/completions`; without a token limit a reply may fill the context."""
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[dict] | None = None
  tool_choice: str | dict | None = None
  parallel_tool_calls: bool | None = None
  response_format: ResponseFormat | None = None

  @pydantic.model_validator(mode="after")
  def _supported(self) -> "ChatCompletionRequest":
    self._check_shared()
    if self.logprobs or self.top_logprobs is not None:
      raise ValueError("logprobs and top_logprobs are not supported")
    if self.tools or self.tool_choice not in (None, "none"):
      raise ValueError("tools and tool_choice are not supported")
    if self.response_format is not None and self.response_format.type != "text":
      raise ValueError(f"response_format type {self.response_format.type!r} is not supported; "
                       "only 'text' is")
    if (self.max_tokens is not None and self.max_completion_tokens is not None
        and self.max_tokens != self.max_completion_tokens):
      raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
    return self

  def token_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

  def conversation(self) -> list[dict[str, str]]:
    return [m.as_dict() for m in self.messages]


def error_messages(errors: list[dict], skip: tuple[str, ...] = ()) -> list[tuple[str, str | None]]:
  """(message, field) per distinct pydantic error, in the wording of the server's 400 responses:
  'field: problem', or 'field is not a supported field'. Location parts in `skip` are dropped."""
  out: list[tuple[str, str | None]] = []
  for error in errors:
    name = ".".join(str(part) for part in error["loc"] if part not in skip)
    if error["type"] == "extra_forbidden":
      message = f"{name} is not a supported field"
    else:
      text = str(error["msg"]).removeprefix("Value error, ")
      message = f"{name}: {text}" if name else text
    if message not in (m for m, _ in out):
      out.append((message, name or None))
  return out
