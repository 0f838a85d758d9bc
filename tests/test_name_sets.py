"""Every name set an argument is checked against has exactly one definition.

A set (the attention implementations, the dtypes, the quantizations, the preemption modes, ...)
is written once as a literal in its owner's module; every other use derives from it. This test
reads the library's source and the scripts' flag definitions for literal collections (tuples,
lists, sets, dict keys) that copy a set: the same names ("auto" aside), or all but one of them, or
one more. Each set must have exactly one such literal, in its owner's module; a derived set (the
KV cache dtypes: the model dtypes and int8) has none of its own.
"""

import ast
import dataclasses
import pathlib

from jaxtier.attention import names
from jaxtier.common import choices
from jaxtier.common.kv_bytes import ELEMENT_BYTES
from jaxtier.engine import args as engine_args
from jaxtier.scheduler.policies import VICTIM_POLICIES
from jaxtier.scheduler.scheduler_config import PREEMPTION_MODES

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHOICES = "jaxtier/common/choices.py"
ARGS = "jaxtier/engine/args.py"
# name -> (the set, the file whose literal defines it)
SETS = {
    "attention implementations": (names.ATTENTION_IMPLS, "jaxtier/attention/names.py"),
    "attention paths": (names.ATTENTION_PATHS, "jaxtier/attention/names.py"),
    "platforms": (choices.PLATFORMS, CHOICES),
    "dtypes": (tuple(choices.DTYPE_BYTES), CHOICES),
    "quantizations": (choices.QUANTIZATIONS, CHOICES),
    "quantization group sizes": (choices.QUANTIZATION_GROUP_SIZES, CHOICES),
    "block activations": (choices.BLOCK_ACTIVATIONS, CHOICES),
    "expert offload modes": (choices.EXPERT_OFFLOAD_MODES, CHOICES),
    "preemption modes": (PREEMPTION_MODES, "jaxtier/scheduler/scheduler_config.py"),
    "victim policies": (tuple(VICTIM_POLICIES), "jaxtier/scheduler/policies.py"),
    "layer executions": (engine_args.LAYER_EXECUTIONS, ARGS),
    "kernels": (engine_args.KERNELS, ARGS),
    "weight formats": (engine_args.WEIGHT_FORMATS, ARGS),
}
# Sets derived from an owned one (name -> (the set, the file of the set it derives from)): no
# literal copies them but, at most, the owned set's.
DERIVED = {"kv cache dtypes": (tuple(ELEMENT_BYTES), CHOICES),
           "engine attention implementations": (names.ENGINE_ATTENTION_IMPLS,
                                                "jaxtier/attention/names.py")}


def _constants(node) -> frozenset | None:
  """The constants of a literal collection (a dict's keys), or None for anything else."""
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    items = node.elts
  elif isinstance(node, ast.Dict) and None not in node.keys:
    items = node.keys
  else:
    return None
  if len(items) < 2 or not all(isinstance(i, ast.Constant) for i in items):
    return None
  return frozenset(i.value for i in items)


def _scripts_flag_literals(tree) -> list:
  """The literal choices of a script's flags (`flags.DEFINE_enum(name, default, choices, ...)`)."""
  found = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("DEFINE_enum", "DEFINE_multi_enum") and len(node.args) > 2):
      found.append(node.args[2])
  return found


def _literals() -> list[tuple[frozenset, str]]:
  """(constants, "path:line") of every literal collection of the library and every literal
  choice list of a script's flags."""
  out = []
  for path in sorted(ROOT.glob("jaxtier/**/*.py")) + sorted(ROOT.glob("scripts/*.py")):
    tree = ast.parse(path.read_text(), str(path))
    nodes = ast.walk(tree) if path.parts[-2] != "scripts" else _scripts_flag_literals(tree)
    for node in nodes:
      constants = _constants(node)
      if constants is not None:
        out.append((constants, f"{path.relative_to(ROOT)}:{node.lineno}"))
  return out


def _copies(names_set, literals) -> list[str]:
  """Where a literal copies `names_set`: the same names ("auto" aside), or one more, or (of a set
  of four or more) one fewer."""
  wanted = frozenset(names_set) - {"auto"}
  found = []
  for constants, where in literals:
    got = constants - {"auto"}
    if got == wanted or (len(got ^ wanted) == 1 and len(got & wanted) >= 2
                         and (got > wanted or len(wanted) >= 4)):
      found.append(where)
  return found


def test_each_name_set_has_one_definition_in_its_owner():
  literals = _literals()
  wrong = {}
  for name, (names_set, owner) in SETS.items():
    found = _copies(names_set, literals)
    if len(found) != 1 or not found[0].startswith(owner + ":"):
      wrong[name] = found
  for name, (names_set, source) in DERIVED.items():
    found = [where for where in _copies(names_set, literals) if not where.startswith(source + ":")]
    if found:
      wrong[name] = found
  assert not wrong, f"name sets written more than once or outside their owner: {wrong}"


def test_the_kv_cache_dtypes_are_the_model_dtypes_and_int8():
  assert set(ELEMENT_BYTES) == set(choices.DTYPE_BYTES) | {"int8"}


def test_every_engine_argument_checks_against_an_owned_set():
  """An engine argument's fixed values are an owned set (with "auto" where the machine
  decides), not a copy of one."""
  owned = [frozenset(s) - {"auto"} for s, _ in list(SETS.values()) + list(DERIVED.values())]
  for field in dataclasses.fields(engine_args.EngineArgs):
    fixed = engine_args.field_choices(field.name)
    if fixed is not None:
      assert frozenset(fixed) - {"auto"} in owned, (field.name, fixed)


def test_the_copy_search_finds_a_copy():
  literals = [(frozenset({"auto", "float32", "bfloat16"}), "a:1"),
              (frozenset({"float32", "bfloat16", "float16"}), "b:2"),
              (frozenset({"xla", "cpu", "pallas"}), "c:3"), (frozenset({"float32", "int16"}), "d:4")]
  assert _copies(("float32", "bfloat16"), literals) == ["a:1", "b:2"]
  assert _copies(("xla", "cpu", "pallas", "reference"), literals) == ["c:3"]
  assert _copies(("cpu", "gpu", "tpu"), [(frozenset({"gpu", "tpu"}), "e:5")]) == []
