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

Limits (`GrammarLimits`, engine arguments of the same names): a constraint is checked against
them by `checked_grammar` before its request is queued, cheap checks first (its bytes, the
strings of a `choice` or an `enum`, the nesting of a schema: pure Python, milliseconds for a
megabyte), then llguidance's own validation under its parser limits (lexer states, fuel). A
constraint past a limit is a `StructuredOutputsError` naming the limit and the field. Building a
matcher (`GrammarMatcher`, tenths of a second for tens of thousands of strings) is left to the
engine's compile workers (`jaxtier.engine.grammars`); llguidance releases the GIL while it builds
and while it computes masks, so other threads keep running.

A `choice` is one lexeme, an alternation of its strings: the lexer's automaton holds the whole
list, where a rule with one alternative per string (llguidance's own `grammar_from("choice")`)
puts every string in one row of the Earley parser, which llguidance caps at 2,000 items.
"""

import dataclasses
import json
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import numpy as np

from jaxtier.common.grammar_limits import GrammarLimits
from jaxtier.text.tokenizer import Tokenizer

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def parser_limits(limits: GrammarLimits) -> llguidance.LLParserLimits:
  """llguidance's limits: its defaults, with the lexer state cap of `limits` and terse errors."""
  return llguidance.LLParserLimits(max_lexer_states=limits.grammar_max_lexer_states,
                                   verbose_errors=False)


_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxdict = 8
_SHORT.maxstring = _SHORT.maxother = 80


def _short(value) -> str:
  """`value`'s repr cut short: an error about a megabyte constraint does not echo it."""
  return _SHORT.repr(value)


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
                                     f"non-empty strings, got {_short(choice)}")
      object.__setattr__(self, "choice", tuple(choice))
    if self.json is not None:
      schema = self.json
      if isinstance(schema, str):
        try:
          schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
          raise StructuredOutputsError("structured_outputs.json",
                                       f"structured_outputs.json is not valid JSON: {e}") from None
      if not isinstance(schema, (Mapping, bool)):
        raise StructuredOutputsError("structured_outputs.json", "structured_outputs.json must "
                                     f"be a JSON schema (an object), got {_short(self.json)}")
      object.__setattr__(self, "json", schema)
    for name in ("regex", "grammar"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, str) and value):
        raise StructuredOutputsError(f"structured_outputs.{name}", f"structured_outputs.{name} "
                                     f"must be a non-empty string, got {_short(value)}")
    if self.json_object not in (None, True, False):
      raise StructuredOutputsError("structured_outputs.json_object",
                                   "structured_outputs.json_object must be true or false, got "
                                   f"{self.json_object!r}")

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
                                   f"with one of {', '.join(FIELDS)}, got {_short(value)}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
      raise StructuredOutputsError("structured_outputs", f"structured_outputs has unknown "
                                   f"fields {unknown}; expected one of {', '.join(FIELDS)}")
    return cls(**value)

  def llguidance_grammar(self, limits: GrammarLimits | None = None) -> str:
    """The constraint as an llguidance grammar, checked against `limits` (`checked_grammar`;
    default `GrammarLimits()`). Raises StructuredOutputsError if it is invalid or too large."""
    return checked_grammar(self, limits or GrammarLimits())


def _grammar_of(params: StructuredOutputsParams) -> str:
  """The constraint as an llguidance grammar, not yet validated."""
  name = params.field
  try:
    if name == "json":
      return llguidance.LLMatcher.grammar_from_json_schema(
          params.json, defaults={"whitespace_flexible": False})
    if name == "json_object":
      return llguidance.LLMatcher.grammar_from_json_schema(
          {"type": "object"}, defaults={"whitespace_flexible": False})
    if name == "regex":
      return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if name == "choice":  # one lexeme: see the module docstring
      return llguidance.LLMatcher.grammar_from_lark(
          "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)
  except (ValueError, TypeError, RecursionError) as e:
    raise StructuredOutputsError(f"structured_outputs.{name}",
                                 f"structured_outputs.{name} is invalid: {e}") from None


def _size(params: StructuredOutputsParams) -> int:
  """The constraint's bytes: its text, its schema's JSON text, or its strings together."""
  name = params.field
  if name == "choice":
    return sum(len(c.encode()) for c in params.choice)
  if name == "json":
    return len(json.dumps(params.json).encode())
  if name in ("regex", "grammar"):
    return len(getattr(params, name).encode())
  return 0


def _schema_shape(schema) -> tuple[int, int]:
  """(the nesting depth of `schema`'s objects and arrays, the most values of one `enum`),
  walked without recursion, so a schema nested thousands deep is measured, not a RecursionError."""
  deepest, most, stack = 0, 0, [(schema, 1)]
  while stack:
    node, depth = stack.pop()
    if isinstance(node, Mapping):
      deepest = max(deepest, depth)
      enum = node.get("enum")
      if isinstance(enum, list):
        most = max(most, len(enum))
      stack += [(value, depth + 1) for value in node.values()]
    elif isinstance(node, list):
      deepest = max(deepest, depth)
      stack += [(value, depth + 1) for value in node]
  return deepest, most


def check_limits(params: StructuredOutputsParams, limits: GrammarLimits) -> None:
  """Raises StructuredOutputsError naming the limit and the field when `params` is larger than
  `limits` allow (cheap: no grammar is built)."""
  name = params.field
  field = f"structured_outputs.{name}"

  def refuse(what: str, value, limit: str) -> None:
    raise StructuredOutputsError(field, f"{field} has {what} {value:,}, more than "
                                 f"{limit}={getattr(limits, limit):,} allows")

  if name == "json":
    # The depth first: JSON text of a schema nested thousands deep cannot even be written.
    depth, items = _schema_shape(params.json)
    if depth > limits.grammar_max_depth:
      refuse("a nesting depth of", depth, "grammar_max_depth")
    if items > limits.grammar_max_items:
      refuse("an enum of", items, "grammar_max_items")
  if name == "choice" and len(params.choice) > limits.grammar_max_items:
    refuse("a choice of", len(params.choice), "grammar_max_items")
  size = _size(params)
  if size > limits.grammar_max_bytes:
    refuse("bytes:", size, "grammar_max_bytes")


def checked_grammar(params: StructuredOutputsParams, limits: GrammarLimits) -> str:
  """`params` as an llguidance grammar, checked: its limits (`check_limits`), then llguidance's
  validation under `parser_limits(limits)`. Raises StructuredOutputsError naming the field.

  Remembered on `params` for the same limits, so a constraint the server checked is not checked
  again by the engine."""
  memo = params.__dict__.get("_checked")
  if memo is not None and memo[0] == limits:
    return memo[1]
  check_limits(params, limits)
  grammar = _grammar_of(params)
  name = params.field
  try:
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits(limits))
  except (ValueError, TypeError, RecursionError) as e:
    error = str(e)
  if error:
    raise StructuredOutputsError(f"structured_outputs.{name}",
                                 f"structured_outputs.{name} is invalid: {error}")
  object.__setattr__(params, "_checked", (limits, grammar))
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

  def __init__(self, ll_tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams,
               limits: GrammarLimits | None = None):
    limits = limits or GrammarLimits()
    self._matcher = llguidance.LLMatcher(ll_tokenizer, checked_grammar(params, limits),
                                         log_level=0, limits=parser_limits(limits))
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
