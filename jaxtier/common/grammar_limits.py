"""What one request's structured-output constraint may cost: `GrammarLimits`.

A leaf (no imports beyond the standard library), so the engine arguments, which import no JAX,
can build one; `jaxtier.sampling.structured` checks constraints against it.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GrammarLimits:
  """What one request's constraint may cost (the engine arguments of the same names; see
  `jaxtier.engine.args.EngineArgs` for the reasons behind each default).

  Attributes:
    grammar_max_bytes: the constraint's size: a schema's JSON text, a regex or grammar's text, a
      choice's strings together.
    grammar_max_items: strings in a `choice`, values in one `enum` of a schema.
    grammar_max_depth: nesting of a JSON schema's objects and arrays.
    grammar_max_lexer_states: llguidance's lexer automaton (about 1-2 kB a state).
    grammar_compile_timeout_s: seconds one grammar may take to compile in a worker.
  """
  grammar_max_bytes: int = 1_000_000
  grammar_max_items: int = 65_536
  grammar_max_depth: int = 100
  grammar_max_lexer_states: int = 50_000
  grammar_compile_timeout_s: float = 10.0
