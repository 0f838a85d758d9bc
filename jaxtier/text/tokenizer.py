"""Tokenizer and chat template, as Hugging Face applies them.

Text is encoded with the `tokenizers` library (the same Rust code `transformers` uses) and chat
templates are rendered with jinja2 in the environment `transformers` uses (`trim_blocks`,
`lstrip_blocks`, loop controls, `raise_exception`, `tojson`).

`Tokenizer.min_token_count` bounds a text's token count from below without tokenizing it (one pass
over the text), so an obviously too long prompt is refused before the tokenizer works through
megabytes of it.
"""

import dataclasses
import functools
import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

Message = dict[str, Any]

# Pre-tokenizers that keep every byte of the text (a "Removed" split behavior drops the delimiters,
# Whitespace and friends drop the spaces) and normalizers the bound can measure through.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Punctuation", "Metaspace", "UnicodeScripts",
                           "Split"}
_MEASURED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}
_MAX_CHAR_BYTES = 4  # UTF-8


def byte_level_symbols() -> list[str]:
  """The character standing for each byte 0-255 in byte-level BPE vocabularies (GPT-2's map:
  printable Latin-1 bytes stand for themselves, the others for U+0100 on, in byte order)."""
  kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)}
  others = iter(range(256, 512))
  return [chr(b) if b in kept else chr(next(others)) for b in range(256)]


@dataclasses.dataclass(frozen=True)
class TokenBound:
  """What bounds a text's token count from below: the most bytes of (normalized) UTF-8 text one
  token stands for, and the bytes a byte-level vocabulary has no symbol for (BPE drops them)."""
  max_token_bytes: int
  dropped_bytes: bytes = b""

  def min_tokens(self, data: bytes) -> int:
    """A lower bound on the tokens of UTF-8 `data` (one C-speed pass)."""
    if self.dropped_bytes:
      data = data.translate(None, self.dropped_bytes)
    return -(-len(data) // self.max_token_bytes)


def _components(spec: dict | None, key: str) -> list[dict]:
  """The steps of a normalizer or pre-tokenizer spec (`Sequence`s flattened)."""
  if spec is None:
    return []
  if spec["type"] == "Sequence":
    return [step for part in spec[key] for step in _components(part, key)]
  return [spec]


def token_bound(backend: tokenizers.Tokenizer) -> TokenBound | None:
  """The `TokenBound` of `backend`, or None when its pipeline gives none (then any text might be
  a single token).

  Known here: BPE models behind pre-tokenizers that keep every byte. Byte-level BPE stands for
  one byte per character of a vocabulary entry; a byte without a symbol in the vocabulary is
  dropped, so it is not counted. Character BPE stands for at most the UTF-8 bytes of an entry and
  needs a byte fallback or an unfused unknown token (one per character) so that no character
  vanishes. Added tokens stand for their content (raw or normalized, whichever is longer) and must
  not strip the spaces around them (that could swallow any number of spaces).
  """
  spec = json.loads(backend.to_str())
  model = spec["model"]
  if spec.get("truncation") or model["type"] != "BPE":
    return None
  if any(step["type"] not in _MEASURED_NORMALIZERS
         for step in _components(spec.get("normalizer"), "normalizers")):
    return None
  pre = _components(spec.get("pre_tokenizer"), "pretokenizers")
  if any(step["type"] not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") == "Removed"
         for step in pre):
    return None
  vocab = backend.get_vocab(with_added_tokens=False)
  dropped = b""
  if any(step["type"] == "ByteLevel" for step in pre):
    dropped = bytes(b for b, symbol in enumerate(byte_level_symbols()) if symbol not in vocab)
    longest = max(map(len, vocab))
  else:
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    if not ((model.get("byte_fallback") and byte_tokens <= vocab.keys())
            or (model.get("unk_token") is not None and not model.get("fuse_unk"))):
      return None
    longest = max(_MAX_CHAR_BYTES, max(len(t.encode("utf-8")) for t in vocab))
  normalizer = backend.normalizer
  for added in spec["added_tokens"]:
    if added["lstrip"] or added["rstrip"]:
      return None
    content = added["content"]
    normalized = normalizer.normalize_str(content) if normalizer is not None else content
    longest = max(longest, len(content.encode("utf-8")), len(normalized.encode("utf-8")))
  return TokenBound(longest, dropped)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
  return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special tokens and chat template a model was trained with."""
  backend: tokenizers.Tokenizer
  eos_token_ids: tuple[int, ...]
  bos_token: str | None = None
  eos_token: str | None = None
  chat_template: str | None = None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  @functools.cached_property
  def _token_bound(self) -> TokenBound | None:
    return token_bound(self.backend)

  def min_token_count(self, text: str) -> int:
    """A lower bound on `len(self.encode(text))` from the text's UTF-8 bytes (normalized first
    when the tokenizer normalizes; see `token_bound`), without tokenizing; 0 when the tokenizer
    gives no bound or the text is not valid Unicode."""
    bound = self._token_bound
    if bound is None:
      return 0
    try:
      if self.backend.normalizer is not None:
        text = self.backend.normalizer.normalize_str(text)
      return bound.min_tokens(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: encode() refuses the text anyway
      return 0

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special tokens (such as BOS) are added as the tokenizer config says."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                          tools: Sequence[dict] | None = None) -> str:
    """The prompt text for a conversation, rendered with the model's chat template (`tools`, the
    OpenAI tool definitions, as the template's `tools` variable, as `transformers` passes them)."""
    if self.chat_template is None:
      raise ValueError("this model's tokenizer has no chat template; pass plain prompts to "
                       "generate() instead of conversations to chat()")
    validate_messages(messages)
    return _compile_template(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        **({} if tools is None else {"tools": list(tools)}))

  def encode_chat(self, messages: Sequence[Message]) -> list[int]:
    """Token ids of a rendered conversation (the template writes the special tokens itself)."""
    return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

  def save(self, directory: str) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` in Hugging Face layout."""
    os.makedirs(directory, exist_ok=True)
    self.backend.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": self.bos_token, "eos_token": self.eos_token,
              "chat_template": self.chat_template, "eos_token_ids": list(self.eos_token_ids)}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=1)


def validate_messages(messages: Sequence[Message]) -> None:
  """Checks a conversation is a non-empty list of {"role", "content"} dicts."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
    raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
    if not isinstance(m["content"], str):
      raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # AddedToken serialized as a dict
    return value.get("content")
  return value


def _eos_ids_from_config(directory: str) -> list[int]:
  ids: list[int] = []
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      with open(path) as f:
        value = json.load(f).get("eos_token_id")
      ids += value if isinstance(value, list) else ([value] if value is not None else [])
  return ids


CHAT_TEMPLATE_FILE = "chat_template.jinja"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
_JINJA_CHARS = "{}\n"


def default_chat_template(value) -> str | None:
  """The template `transformers` applies when none is named: a string as it is; of named
  templates (a dict, or the list of {"name", "template"} that tokenizer_config.json stores), the
  one named "default" (None when there is none)."""
  if isinstance(value, list):
    value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
  if isinstance(value, dict):
    value = value.get("default")
  return value if isinstance(value, str) else None


def read_chat_template(directory: str, config: dict) -> str | None:
  """A Hugging Face directory's chat template, found where `transformers` looks: its own file
  `chat_template.jinja` (what `save_pretrained` writes today), else the older
  `chat_template.json` ({"chat_template": ...}), else tokenizer_config.json's "chat_template"."""
  path = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  path = os.path.join(directory, LEGACY_CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return default_chat_template(json.load(f).get("chat_template"))
  return default_chat_template(config.get("chat_template"))


def resolve_chat_template(value: str) -> str:
  """The template an engine's `chat_template` argument names: the text of a file at that path,
  or, for a value holding a brace or a newline (which no sensible path does), the template
  itself, as vLLM's `--chat-template` takes it. Raises ValueError for a path that cannot be read
  or a template jinja2 cannot parse."""
  if not isinstance(value, str) or not value:
    raise ValueError(f"chat_template={value!r}: expected a .jinja file path or a template string")
  if not any(c in value for c in _JINJA_CHARS):
    try:
      with open(value, encoding="utf-8") as f:
        value = f.read()
    except OSError as e:
      raise ValueError(f"chat_template={value!r} looks like a file path but cannot be read "
                       f"({e.strerror}); expected a .jinja file or a template string") from None
  try:
    _compile_template(value)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f"chat_template: the template does not parse: {e} (line {e.lineno})"
                     ) from None
  return value


def load_tokenizer_dir(directory: str) -> Tokenizer:
  """Loads `tokenizer.json`, `tokenizer_config.json` and the chat template (see
  `read_chat_template`) of a Hugging Face (or jaxtier) directory."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} has no tokenizer.json")
  backend = tokenizers.Tokenizer.from_file(path)
  config: dict = {}
  config_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(config_path):
    with open(config_path) as f:
      config = json.load(f)
  template = read_chat_template(directory, config)
  bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
  eos_ids = list(config.get("eos_token_ids", [])) + _eos_ids_from_config(directory)
  if eos is not None and backend.token_to_id(eos) is not None:
    eos_ids.append(backend.token_to_id(eos))
  return Tokenizer(backend, tuple(dict.fromkeys(eos_ids)), bos, eos, template)
