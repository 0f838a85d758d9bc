"""Structured outputs: the constraint a request's text must satisfy, and its grammar matcher.

`StructuredOutputsParams` has vLLM's shape: exactly one of `json` (a JSON schema, as a dict or a
string), `regex`, `choice` (a list of strings), `grammar` (a Lark grammar) or `json_object`
(any JSON object). Each is turned into an llguidance grammar and checked when the parameters are
made, so a bad schema, regex or grammar is a ValueError naming its field.

llguidance (the grammar engine vLLM and llama.cpp use) computes, for a grammar's state, the
bitmask of tokens that may come next: one bit per vocabulary entry in int32 words (bit i % 32 of
word i // 32). The engine keeps one `GrammarMatcher` per constrained request on the host: before
a step samples for it the mask enters the sampling program as an array
(`jaxtier.sampling.LogitsArrays.grammar_bw`), after the token is read the matcher consumes it.
The matcher only ever sees the request's generated tokens, so preemption (swap or recompute) and
prefix-cache hits, which recompute or load only KV, leave it as it was.

Why llguidance: masks take microseconds per token on the default model's 49,152-token vocabulary
(its lexer walks a token trie; see WORKSPACE.md), it needs no torch, and it reads a
`tokenizers` JSON directly.
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import numpy as np

from jaxtier.text.tokenizer import Tokenizer

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(ValueError):
  """A bad constraint; `field` names the part of `structured_outputs` at fault."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
  """One request's output constraint (vLLM's `StructuredOutputsParams`): exactly one field set.

  Attributes:
    json: a JSON schema (a dict, or its JSON text); the output is a JSON value it accepts.
    regex: the output matches this regular expression (Rust `regex` syntax) as a whole.
    choice: the output is one of these strings.
    grammar: a Lark grammar (llguidance's dialect) the output is a sentence of.
    json_object: True: the output is any JSON object.
  """
  json: Mapping[str, Any] | str | None = None
  regex: str | None = None
  choice: Sequence[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None

  def __post_init__(self):
    given = [name for name in FIELDS if getattr(self, name) not in (None, False)]
    if len(given) != 1:
      raise StructuredOutputsError(
          "structured_outputs", "structured_outputs must set exactly one of "
          f"{', '.join(FIELDS)}; got {', '.join(given) if given else 'none'}")
    if self.choice is not None:
      choice = self.choice
      if (isinstance(choice, str) or not isinstance(choice, Sequence) or not choice
          or not all(isinstance(c, str) and c for c in choice)):
        raise StructuredOutputsError("structured_outputs.choice",
                                     "structured_outputs.choice must be a non-empty list of "
                                     f"non-empty strings, got {choice!r}")
      object.__setattr__(self, "choice", tuple(choice))
    if self.json is not None:
      schema = self.json
      if isinstance(schema, str):
        try:
          schema = json.loads(schema)
        except json.JSONDecodeError as e:
          raise StructuredOutputsError("structured_outputs.json",
                                       f"structured_outputs.json is not valid JSON: {e}") from None
      if not isinstance(schema, (Mapping, bool)):
        raise StructuredOutputsError("structured_outputs.json", "structured_outputs.json must "
                                     f"be a JSON schema (an object), got {self.json!r}")
      object.__setattr__(self, "json", schema)
    for name in ("regex", "grammar"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, str) and value):
        raise StructuredOutputsError(f"structured_outputs.{name}", f"structured_outputs.{name} "
                                     f"must be a non-empty string, got {value!r}")
    if self.json_object not in (None, True, False):
      raise StructuredOutputsError("structured_outputs.json_object",
                                   "structured_outputs.json_object must be true or false, got "
                                   f"{self.json_object!r}")
    self.llguidance_grammar()  # checked now, so a bad one is refused before it is queued

  @property
  def field(self) -> str:
    """The field that is set."""
    return next(name for name in FIELDS if getattr(self, name) not in (None, False))

  @classmethod
  def of(cls, value) -> "StructuredOutputsParams":
    """`value` as parameters: itself, or a mapping of the fields (what JSON gives)."""
    if isinstance(value, cls):
      return value
    if not isinstance(value, Mapping):
      raise StructuredOutputsError("structured_outputs", "structured_outputs must be an object "
                                   f"with one of {', '.join(FIELDS)}, got {value!r}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
      raise StructuredOutputsError("structured_outputs", f"structured_outputs has unknown "
                                   f"fields {unknown}; expected one of {', '.join(FIELDS)}")
    return cls(**value)

  def llguidance_grammar(self) -> str:
    """The constraint as an llguidance grammar (checked: StructuredOutputsError if invalid)."""
    name = self.field
    try:
      if name == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            self.json, defaults={"whitespace_flexible": False})
      elif name == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": False})
      elif name == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(self.regex)
      elif name == "choice":
        grammar = llguidance.grammar_from("choice", list(self.choice))
      else:
        grammar = llguidance.LLMatcher.grammar_from_lark(self.grammar)
    except (ValueError, TypeError) as e:
      raise StructuredOutputsError(f"structured_outputs.{name}",
                                   f"structured_outputs.{name} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
      raise StructuredOutputsError(f"structured_outputs.{name}",
                                   f"structured_outputs.{name} is invalid: {error}")
    return grammar


def mask_words(vocab_size: int) -> int:
  """int32 words of one row's token bitmask."""
  return (vocab_size + 31) // 32


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
  """llguidance's view of `tokenizer` for a model of `vocab_size` logits (ids the tokenizer does
  not have are never allowed; a tokenizer larger than the model's logits keeps its size, and
  the sampler reads the mask's first `vocab_size` bits). Takes ~0.3 s for a 49k vocabulary:
  build it once per engine."""
  return llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                n_vocab=max(vocab_size, tokenizer.vocab_size),
                                eos_token=list(tokenizer.eos_token_ids) or None)


class GrammarMatcher:
  """The grammar state of one request: the mask of its next token, advanced by the tokens it
  generates."""

  def __init__(self, ll_tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams):
    self._matcher = llguidance.LLMatcher(ll_tokenizer, params.llguidance_grammar(), log_level=0)
    self.vocab_size = ll_tokenizer.vocab_size
    if self._matcher.is_error():
      raise StructuredOutputsError(f"structured_outputs.{params.field}",
                                   f"structured_outputs.{params.field} is invalid: "
                                   f"{self._matcher.get_error()}")

  def mask(self) -> np.ndarray:
    """[mask_words(vocab)] int32 bitmask of the tokens that may come next (all zeros when the
    matcher is in error or complete)."""
    out = np.zeros(mask_words(self.vocab_size), np.int32)
    if not self._matcher.is_error():
      self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out

  def consume(self, token: int) -> bool:
    """Advances by a generated token; False when the grammar rejects it (then `error` says why)."""
    return self._matcher.consume_token(token) and not self._matcher.is_error()

  @property
  def stopped(self) -> bool:
    """The grammar is complete: no token but EOS may follow."""
    return self._matcher.is_stopped()

  @property
  def error(self) -> str | None:
    return self._matcher.get_error() if self._matcher.is_error() else None


def closed_objects(schema):
  """`schema` with `"additionalProperties": false` added to every object schema that does not
  say (OpenAI's strict mode: no keys but the listed ones). llguidance, like JSON Schema, allows
  other keys when a schema does not say."""
  if isinstance(schema, list):
    return [closed_objects(s) for s in schema]
  if not isinstance(schema, Mapping):
    return schema
  out = {key: closed_objects(value) for key, value in schema.items()}
  if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
    out["additionalProperties"] = False
  return out
