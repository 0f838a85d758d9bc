"""Request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`) and their mapping
onto `SamplingParams`.

Unknown fields are rejected, and so are known fields whose meaning the engine does not implement
(`suffix`, ...): a request is either served as asked or answered with 400. Every 400 about a field
names it in the error's `param` (pydantic's location, or the `SamplingParams` field a value
failed, under the request's name for it).

Sampling fields: OpenAI's (`temperature`, `top_p`, `frequency_penalty`, `presence_penalty`,
`logit_bias` with token ids as string keys, `seed`, `stop`, ...) and vLLM's extra ones, read at the
top level of the body as vLLM reads them (the `openai` client sends them through `extra_body`):
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`allowed_token_ids`, `bad_words`.

Structured outputs (both endpoints): OpenAI's `response_format` (`{"type": "json_object"}`, or
`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`; strict adds
`"additionalProperties": false` to every object schema that does not say) and vLLM's
`structured_outputs` (`{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`), one of
the two per request. A bad schema, regex or grammar is a 400 naming the field that holds it.

Tools (chat): OpenAI's `tools` (functions) and `tool_choice` ("none", "auto", "required" or a
named function; "auto" when tools are given, else "none"); `jaxtier.server.tool_calls` renders them,
enforces "required" and named choices with a grammar, and parses the calls. A constraint from
the tool choice and one from `response_format` / `structured_outputs` cannot be combined.

Accepted and ignored, because they do not change what a text-only completion generates:
- both endpoints: `user` (an end-user id for abuse monitoring), `stream_options.include_obfuscation`
  when false (true asks for padding fields in streamed events, which are not sent: a 400);
- chat completions, as OpenAI's schema has them: `metadata` (string pairs for stored completions),
  `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention` (cache
  routing and billing), `modalities` when it is `["text"]`.
Not ignored (400) because they would change the output: `audio`, `prediction`, `reasoning_effort`,
`verbosity`, `web_search_options`, `functions`, `function_call`, other modalities.

Text that reaches the tokenizer (prompts, message contents, stop strings) must be valid Unicode:
JSON can carry a lone surrogate (`"\\ud800"`), which is a 400 naming the field.
"""

from typing import Literal

import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from jaxtier.sampling.logprobs import MAX_LOGPROBS
from jaxtier.sampling.samplers import SamplingParamError, SamplingParams
from jaxtier.sampling.structured import StructuredOutputsError, closed_objects
from jaxtier.server import tool_calls as tools_lib

TokenIds = list[int]


def valid_unicode(text: str) -> str:
  """`text`, or ValueError naming its first lone surrogate (JSON can carry one; text cannot)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"contains a lone surrogate (U+{ord(text[e.start]):04X}) at index {e.start}; "
                     "text must be valid Unicode") from None
  return text


def _valid_texts(value: str | list[str], item: str = "item") -> None:
  """`valid_unicode` on a string or on each string of a list (named `<item> <index>`)."""
  if isinstance(value, str):
    valid_unicode(value)
    return
  for j, text in enumerate(value):
    if isinstance(text, str):
      try:
        valid_unicode(text)
      except ValueError as e:
        raise ValueError(f"{item} {j} {e}") from None


def _or(value, default):
  """`value`, or `default` for None (vLLM's protocol sends null for a sampling field it leaves
  at its default)."""
  return default if value is None else value


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: bool = False
  include_obfuscation: bool = False

  @pydantic.field_validator("include_obfuscation")
  @classmethod
  def _no_obfuscation(cls, value: bool) -> bool:
    if value:
      raise ValueError("true is not supported (streamed events carry no obfuscation padding); "
                       "send false or leave it out")
    return value


class JsonSchemaFormat(BaseModel):
  """`response_format.json_schema` (OpenAI's): the schema the reply must follow."""
  model_config = ConfigDict(extra="forbid", populate_by_name=True)
  name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
  description: str | None = None
  json_schema: dict | None = Field(None, alias="schema")
  strict: bool | None = None


class ResponseFormat(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None

  @pydantic.model_validator(mode="after")
  def _schema_with_its_type(self) -> "ResponseFormat":
    if (self.type == "json_schema") != (self.json_schema is not None):
      raise ValueError("json_schema is required with type 'json_schema', and only allowed with it")
    return self

  def structured_outputs(self) -> dict | None:
    """The format as `SamplingParams.structured_outputs` (None for plain text)."""
    if self.type == "json_object":
      return {"json_object": True}
    if self.type == "json_schema":
      schema = self.json_schema.json_schema
      schema = {"type": "object"} if schema is None else schema
      return {"json": closed_objects(schema) if self.json_schema.strict else schema}
    return None


class FunctionSpec(BaseModel):
  model_config = ConfigDict(extra="forbid")
  name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
  description: str | None = None
  parameters: dict | None = None
  strict: bool | None = None


class ToolSpec(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["function"]
  function: FunctionSpec


class NamedFunction(BaseModel):
  model_config = ConfigDict(extra="forbid")
  name: str


class NamedToolChoice(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["function"]
  function: NamedFunction


class _SamplingRequest(BaseModel):
  """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""
  model_config = ConfigDict(extra="forbid")
  model: str | None = None  # None: the served model
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int | None = -1  # None or <= 0: no top-k
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  n: int = Field(1, ge=1, le=128)
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  frequency_penalty: float | None = 0.0
  presence_penalty: float | None = 0.0
  logit_bias: dict[str, float] | None = None
  repetition_penalty: float | None = None  # None: 1 (off)
  min_p: float | None = None  # None: 0 (off)
  min_tokens: int = 0
  allowed_token_ids: list[int] | None = None
  bad_words: list[str] | None = None
  response_format: ResponseFormat | None = None
  structured_outputs: dict | None = None

  @pydantic.field_validator("stop", "bad_words")
  @classmethod
  def _stop_text(cls, value: str | list[str] | None) -> str | list[str] | None:
    if value is not None:
      _valid_texts(value)
    return value

  @pydantic.field_validator("logit_bias")
  @classmethod
  def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or ():
      if not key.strip().isdigit():
        raise ValueError(f"keys must be token ids (strings of integers >= 0), got {key!r}")
    return value

  def _check_shared(self) -> None:
    if self.stream_options is not None and not self.stream:
      raise field_error("stream_options", "stream_options is only allowed together with "
                        "stream=true")
    if self.structured_outputs is not None and self._format_constraint() is not None:
      raise field_error("structured_outputs", "structured_outputs and a response_format other "
                        "than text both constrain the output; send one of them")

  def _format_constraint(self) -> dict | None:
    return None if self.response_format is None else self.response_format.structured_outputs()

  def constraint(self) -> dict | None:
    """`SamplingParams.structured_outputs` of this request, from either field."""
    return self._format_constraint() or self.structured_outputs

  def _check_sampling(self, max_tokens: int | None) -> None:
    """`sampling_params` for a limit of `max_tokens` (None: any), its `SamplingParamError`
    raised as a validation error at the request field that holds the value."""
    try:
      self.sampling_params(max(1, self.min_tokens) if max_tokens is None else max_tokens)
    except SamplingParamError as e:
      raise field_error(*self.located(e.field, str(e))) from None

  def located(self, field: str, message: str) -> tuple[str, str]:
    """(the request field, the message) of an error in `SamplingParams` field `field` (or a
    part of it, "structured_outputs.choice"): a constraint from `response_format` or the tools
    is named as the client sent it."""
    if field.split(".")[0] == "structured_outputs" and self._format_constraint() is not None:
      return "response_format", message.replace(
          "structured_outputs.json_object", "response_format").replace(
              "structured_outputs.json", "response_format.json_schema.schema")
    return self.request_field(field), message

  def request_field(self, field: str) -> str:
    """The request field that holds `SamplingParams` field `field`."""
    return field

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage

  def sampling_params(self, max_tokens: int) -> list[SamplingParams]:
    """One `SamplingParams` per choice; choice j of a seeded request uses seed + j.

    Raises ValueError (from `SamplingParams`) for out-of-range values.
    """
    logprobs, prompt_logprobs = self.logprob_counts()
    bias = None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
    constraint = self.constraint()
    if constraint is not None:  # one object for every choice: the engine checks it once
      constraint = SamplingParams(structured_outputs=constraint).structured_outputs
    return [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=-1 if self.top_k is None else self.top_k,
                           seed=None if self.seed is None else (self.seed + j) % 2**32,
                           stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                           ignore_eos=self.ignore_eos, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs,
                           repetition_penalty=_or(self.repetition_penalty, 1.0),
                           frequency_penalty=_or(self.frequency_penalty, 0.0),
                           presence_penalty=_or(self.presence_penalty, 0.0),
                           min_p=_or(self.min_p, 0.0), logit_bias=bias,
                           allowed_token_ids=self.allowed_token_ids,
                           bad_words=self.bad_words or (), min_tokens=self.min_tokens,
                           structured_outputs=constraint)
            for j in range(self.n)]

  def logprob_counts(self) -> tuple[int | None, int | None]:
    """`SamplingParams.logprobs` and `prompt_logprobs` of each choice (top tokens per entry)."""
    raise NotImplementedError


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
      prompt = handler(value)
    except pydantic.ValidationError:
      raise ValueError("expected a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids") from None
    _valid_texts(prompt)
    return prompt

  @pydantic.model_validator(mode="after")
  def _supported(self) -> "CompletionRequest":
    self._check_shared()
    if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
      raise field_error("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (OpenAI "
                        f"allows up to 5; this server, like vLLM, up to {MAX_LOGPROBS}), got "
                        f"{self.logprobs}")
    if self.suffix:
      raise field_error("suffix", "suffix is not supported")
    if self.best_of is not None and self.best_of != self.n:
      raise field_error("best_of", f"best_of={self.best_of} is not supported; only best_of equal "
                        f"to n (n={self.n}) is")
    if isinstance(self.prompt, list) and not self.prompt:
      raise field_error("prompt", "prompt is an empty list")
    self._check_sampling(1 if self.echo and self.max_tokens == 0 else self.max_tokens)
    return self

  def request_field(self, field: str) -> str:
    return "logprobs" if field == "prompt_logprobs" else field

  def logprob_counts(self) -> tuple[int | None, int | None]:
    """`logprobs` top tokens for each generated token and, when echoed, each prompt token."""
    return self.logprobs, self.logprobs if self.echo else None

  def prompts(self) -> list[str | TokenIds]:
    """The prompts of this request: a string, token ids, or a list of either."""
    if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
      return [self.prompt]
    return list(self.prompt)


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["text"]
  text: str


class CalledFunction(BaseModel):
  model_config = ConfigDict(extra="forbid")
  name: str
  arguments: str


class ToolCall(BaseModel):
  """A call an earlier assistant message made (OpenAI's shape)."""
  model_config = ConfigDict(extra="forbid")
  id: str
  type: Literal["function"]
  function: CalledFunction


class ChatMessage(BaseModel):
  """A message: text from a system, developer, user or assistant; an assistant's tool calls
  (content may then be null); or a tool's result (`tool_call_id` names the call)."""
  model_config = ConfigDict(extra="forbid")
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None
  tool_calls: list[ToolCall] | None = None
  tool_call_id: str | None = None

  @pydantic.field_validator("content")
  @classmethod
  def _content_text(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
    if value is not None:
      _valid_texts(value if isinstance(value, str) else [p.text for p in value], item="part")
    return value

  @pydantic.model_validator(mode="after")
  def _tool_fields(self) -> "ChatMessage":
    if self.tool_calls is not None and self.role != "assistant":
      raise ValueError("tool_calls is only allowed in assistant messages")
    if (self.role == "tool") != (self.tool_call_id is not None):
      raise ValueError("tool messages need a tool_call_id, and only they may have one")
    if self.content is None and not self.tool_calls:
      raise ValueError("content may be null only in an assistant message with tool_calls")
    return self

  def as_dict(self) -> dict:
    """The message as the chat template takes it (text parts joined; tool calls and the call id
    as OpenAI sends them)."""
    content = self.content or ""
    text = content if isinstance(content, str) else "".join(p.text for p in content)
    out = {"role": self.role, "content": text}
    if self.tool_calls:
      out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
    if self.tool_call_id is not None:
      out["tool_call_id"] = self.tool_call_id
    return out


class ChatCompletionRequest(_SamplingRequest):
  """Body of `POST /v1/chat/completions`; without a token limit a reply may fill the context."""
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[ToolSpec] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  # Accepted and ignored (see the module docstring).
  metadata: dict[str, str] | None = None
  store: bool | None = None
  service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
  safety_identifier: str | None = None
  prompt_cache_key: str | None = None
  prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
  modalities: list[str] | None = None

  @pydantic.model_validator(mode="after")
  def _supported(self) -> "ChatCompletionRequest":
    self._check_shared()
    if self.top_logprobs is not None and not self.logprobs:
      raise field_error("top_logprobs", "top_logprobs requires logprobs=true")
    if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
      raise field_error("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                        f"got {self.top_logprobs}")
    self._check_tools()
    if self.modalities is not None and self.modalities != ["text"]:
      raise field_error("modalities", f"modalities {self.modalities} are not supported; only "
                        "['text'] is")
    if (self.max_tokens is not None and self.max_completion_tokens is not None
        and self.max_tokens != self.max_completion_tokens):
      raise field_error("max_completion_tokens", "max_tokens and max_completion_tokens disagree; "
                        "send one of them")
    self._check_sampling(self.token_limit())
    return self

  def _check_tools(self) -> None:
    choice = self.tool_choice
    if choice not in (None, "none") and not self.tools:
      raise field_error("tool_choice", f"tool_choice {self._choice_text()} needs tools")
    names = [t.function.name for t in self.tools or ()]
    if len(set(names)) != len(names):
      raise field_error("tools", "tools have duplicate function names")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
      raise field_error("tool_choice", f"tool_choice names the function "
                        f"{choice.function.name!r}, which is not in tools {names}")
    if self.tool_constraint() is not None and (self.structured_outputs is not None
                                               or self._format_constraint() is not None):
      raise field_error("tool_choice", f"tool_choice {self._choice_text()} constrains the reply, "
                        "and so does response_format or structured_outputs; send one of them")
    for i, tool in enumerate(self.tools or ()):
      try:
        SamplingParams(structured_outputs={"json": tools_lib.parameters(self.tool_dicts()[i])}
                       ).structured_outputs.llguidance_grammar()
      except (SamplingParamError, StructuredOutputsError) as e:
        raise field_error("tools", f"tools {i} ({tool.function.name}): parameters is not a "
                          f"usable JSON schema: {e}") from None

  def _choice_text(self) -> str:
    choice = self.tool_choice
    return (f"{{'function': {choice.function.name!r}}}" if isinstance(choice, NamedToolChoice)
            else repr(choice))

  def effective_tool_choice(self) -> str | dict:
    """The tool choice as `jaxtier.server.tool_calls` takes it ("auto" with tools by default)."""
    if self.tool_choice is None:
      return "auto" if self.tools else "none"
    return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

  def tool_dicts(self) -> list[dict]:
    """The tools as JSON objects (unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in self.tools or ()]

  def tool_constraint(self) -> dict | None:
    if not self.tools:
      return None
    return tools_lib.constraint(self.tool_dicts(), self.effective_tool_choice(),
                                parallel=self.parallel_tool_calls is not False)

  def constraint(self) -> dict | None:
    return self.tool_constraint() or super().constraint()

  def request_field(self, field: str) -> str:
    if field.split(".")[0] == "structured_outputs" and self.tool_constraint() is not None:
      return "tools"
    if field == "max_tokens" and self.max_completion_tokens is not None:
      return "max_completion_tokens"
    return "top_logprobs" if field == "logprobs" else field

  def logprob_counts(self) -> tuple[int | None, int | None]:
    """With logprobs=true, `top_logprobs` (default 0) top tokens for each generated token."""
    return (self.top_logprobs or 0) if self.logprobs else None, None

  def token_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

  def conversation(self) -> list[dict[str, str]]:
    return [m.as_dict() for m in self.messages]


def field_error(field: str, message: str) -> pydantic.ValidationError:
  """A validation error located at `field`, for a check across fields (a model validator's own
  ValueError has no location, so its 400 could not name the field)."""
  error = pydantic_core.PydanticCustomError("value_error", "{message}", {"message": message})
  return pydantic.ValidationError.from_exception_data(
      "request", [pydantic_core.InitErrorDetails(type=error, loc=(field,), input=None)])


def error_messages(errors: list[dict], skip: tuple[str, ...] = ()) -> list[tuple[str, str | None]]:
  """(message, field) per distinct pydantic error, in the wording of the server's 400 responses:
  'field: problem' (the problem alone when it starts with the field's name), or 'field is not a
  supported field'. Location parts in `skip` are dropped."""
  out: list[tuple[str, str | None]] = []
  for error in errors:
    name = ".".join(str(part) for part in error["loc"] if part not in skip)
    if error["type"] == "extra_forbidden":
      message = f"{name} is not a supported field"
    else:
      text = str(error["msg"]).removeprefix("Value error, ")
      message = f"{name}: {text}" if name and not text.startswith(name + " ") else text
    if message not in (m for m, _ in out):
      out.append((message, name or None))
  return out


def _json_kind(value) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "a boolean"
  if isinstance(value, (int, float)):
    return "a number"
  if isinstance(value, str):
    return "a string"
  return "an array"


def body_problem(errors: list[dict], body, content_type: str | None,
                 model: type[BaseModel] | None = None) -> str | None:
  """What is wrong with a request body as a whole, from FastAPI's validation errors and the body
  it read: not JSON (with line and column), empty, not sent as JSON, or not a JSON object. None
  when the body is an object and the errors are about its fields. `model` names the fields an
  empty body misses."""
  if not errors:
    return None
  first = errors[0]
  if first["type"] == "json_invalid":
    pos = first["loc"][-1]
    text = body if isinstance(body, str) else ""
    line, column = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
    reason = first.get("ctx", {}).get("error", "JSON decode error")
    return (f"the request body is not valid JSON: {reason} at line {line} column {column} "
            f"(character {pos})")
  if tuple(first["loc"]) != ("body",):
    return None
  if first["type"] == "missing":
    required = [name for name, field in (model.model_fields.items() if model else ())
                if field.is_required()]
    fields = f" with at least the field {', '.join(required)}" if required else ""
    return f"the request body is empty: expected a JSON object{fields}"
  if first["type"] not in ("model_type", "model_attributes_type", "dict_type"):
    return None  # a check of the whole request (`_supported`)
  if isinstance(first.get("input"), (bytes, bytearray)):
    return ("the request body must be JSON sent with the header Content-Type: application/json "
            f"(got {'Content-Type: ' + content_type if content_type else 'no Content-Type'})")
  return f"the request body must be a JSON object, not {_json_kind(first.get('input'))}"
