"""`jaxtier.LLM`'s engine arguments as absl flags, with the same names, for the scripts.

Importing this module defines `--config` and the engine flags, generated from the fields of
`jaxtier.engine.args.EngineArgs`: their defaults and help texts are written there, once, and a
script lists them in its --help with `flags.adopt_module_key_flags(engine_flags)`. A script calls
`prepare()` first thing in `main` and builds the engine with `jaxtier.LLM(**llm_kwargs())`. Flag values are checked
together (`jaxtier.engine.args.EngineArgs`) when the command line is parsed, before any model is
loaded; importing this module does not import JAX.
"""

import dataclasses
import json
import os
import sys
import typing
from typing import Any, NoReturn

from absl import flags, logging
from ml_collections import config_flags

from jaxtier.common.choices import PLATFORM_ALIASES, PLATFORMS
from jaxtier.engine import args as engine_args
from jaxtier.engine import pinned_cap
from jaxtier.kernels.cpu import heap as cpu_allocator

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "optional ml_collections config file whose fields "
                                "give defaults for the flags (flags given explicitly win)")
flags.DEFINE_bool("dry_run", False, "print the plan the engine flags resolve to (dtype, layer "
                  "execution, both KV pools in blocks and bytes, offloaded layers, prefetch depth, "
                  "weight bytes on the device and in pinned host memory; memory_report()'s keys) "
                  "as one JSON line, the last on stdout, and exit without loading weights; with "
                  "--device_memory_gb and --host_memory_gb, for another machine")
flags.DEFINE_string("compilation_cache_dir", "auto", "where compiled programs are kept between runs "
                    "(JAX's persistent compilation cache): \"auto\" is $JAX_COMPILATION_CACHE_DIR "
                    "where set, else xla/ in jaxtier's per-user cache folder; \"off\" keeps none, "
                    "so every start compiles every program again")
flags.DEFINE_enum("platform", None, list(PLATFORMS + tuple(PLATFORM_ALIASES)), "plan for this "
                  "platform (its dtype and kernels for every \"auto\") instead of this machine's: "
                  "with --dry_run, and in scripts/export_programs.py (default cuda there); give "
                  "its memories with --device_memory_gb and --host_memory_gb")


def _flag_kind(field: dataclasses.Field) -> str:
  """How engine argument `field` is a flag: "enum", "bool", "integer", "float" or "string"."""
  if engine_args.field_choices(field.name):
    return "enum"
  kinds = set(typing.get_args(field.type) or (field.type,)) - {type(None)}
  if kinds == {bool}:
    return "bool"
  if kinds == {int}:
    return "integer"
  if kinds == {float}:
    return "float"
  if kinds <= {int, str}:  # a str, or an int or "auto": parsed by `llm_kwargs`
    return "string"
  raise TypeError(f"EngineArgs.{field.name}: no flag kind for type {field.type}")


def define_flag(name: str, flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines --`name` from the `EngineArgs` field of that name: its kind from the field's type
  (an enum where the field has choices), its default and its help text from the field."""
  field = _FIELDS[name]
  help_text, kind, default = engine_args.field_help(name), _flag_kind(field), field.default
  if kind == "enum":
    flags.DEFINE_enum(name, default, list(engine_args.field_choices(name)), help_text,
                      flag_values=flag_values, module_name=__name__)
  elif kind == "string":
    flags.DEFINE_string(name, None if default is None else str(default), help_text,
                        flag_values=flag_values, module_name=__name__)
  else:
    define = {"bool": flags.DEFINE_bool, "integer": flags.DEFINE_integer,
              "float": flags.DEFINE_float}[kind]
    define(name, default, help_text, flag_values=flag_values, module_name=__name__)


_FIELDS = {f.name: f for f in dataclasses.fields(engine_args.EngineArgs)}
# `seed` stays with each script: the batch job's --seed seeds its records' sampling; serve.py
# defines it from the field (`define_flag("seed")`).
ENGINE_FLAGS = tuple(name for name in engine_args.ARG_NAMES if name != "seed")
for _name in ENGINE_FLAGS:
  define_flag(_name)


def usage_error(message: str) -> NoReturn:
  """Ends the script with one line on stderr, `<script>: error: <message>`, and exit status 2."""
  print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
  sys.exit(2)


def apply_config_defaults() -> None:
  """Copies --config fields into flags not given on the command line, then checks every flag."""
  if FLAGS.config is None:
    return
  for name, value in FLAGS.config.items():
    if name not in FLAGS:
      usage_error(f"--config field {name!r} is not a flag of this script")
    if not FLAGS[name].present:
      FLAGS[name].value = value
  try:
    FLAGS.validate_all_flags()
  except flags.IllegalFlagValueError as e:
    usage_error(str(e))


def prepare() -> None:
  """What an engine script does first: warnings-only logging unless --verbosity is given, --config
  defaults applied, the engine flags checked together (`EngineArgs`; a bad value is one line),
  freed memory retained (`jaxtier.kernels.cpu.heap`, before JAX starts its threads; in one arena
  when offloading), and compiled programs kept on disk (`enable_compilation_cache`); with
  --dry_run, the plan printed and the script ended (`print_plan_and_exit`)."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  apply_config_defaults()
  try:
    args = engine_args.EngineArgs(**llm_kwargs())
  except ValueError as e:
    usage_error(str(e))
  # One arena for every thread only where a step's temporaries may be whole layers (an offloaded
  # tail, or "auto"): it makes the host thread's dispatch contend with XLA's threads for the lock.
  cpu_allocator.retain_freed_memory(single_arena=args.offload_tail_layers != 0)
  # XLA reads its pinned-memory cap when JAX starts: raised first where the flags may pin more
  pinned_cap.raise_before_start(args, pinned_cap.host_memory(args))
  enable_compilation_cache()
  if FLAGS.dry_run:
    print_plan_and_exit()


def check_model(model: str) -> None:
  """A usage error, at once (before JAX is imported), unless `model` is a registered model or a
  readable file or directory."""
  from jaxtier.checkpoint import registry  # pylint: disable=g-import-not-at-top  (no JAX)
  if registry.find_manifest(model) is not None:
    return
  if not os.path.exists(model):
    usage_error(f"--model={model}: neither a registered model ({registry.known_models()}) nor an "
                "existing file or directory")
  if not os.access(model, os.R_OK):
    usage_error(f"--model={model}: cannot be read (permission denied)")


def print_plan_and_exit() -> NoReturn:
  """--dry_run: the plan (`jaxtier.engine.build.plan`'s memory plan) as one JSON line, then exit 0;
  a plan the arguments cannot make (too little memory, a pool the host cannot pin) is a usage
  error."""
  from jaxtier.engine import build  # pylint: disable=g-import-not-at-top  (JAX loads only now)
  kwargs = llm_kwargs()
  try:
    plan = build.plan(kwargs["model"], engine_args.EngineArgs(**kwargs), FLAGS.platform)
  except ValueError as e:
    usage_error(str(e))
  print(json.dumps(plan.memory_plan()), flush=True)
  sys.exit(0)


def enable_compilation_cache() -> str | None:
  """Keeps compiled programs on disk (JAX's persistent compilation cache) where
  --compilation_cache_dir says (`startup.enable_compilation_cache`): a rerun of a script skips
  the compiles of every program it ran before (seconds each). Returns the folder, None when off."""
  from jaxtier.engine import startup  # pylint: disable=g-import-not-at-top  (JAX loads only now)
  return startup.enable_compilation_cache(
      compilation_cache_dir(FLAGS["compilation_cache_dir"].value))


def compilation_cache_dir(value: str) -> str | None:
  """The folder --compilation_cache_dir=`value` names: None for "off"; for "auto",
  $JAX_COMPILATION_CACHE_DIR where set, else xla/ in jaxtier's per-user cache folder."""
  if value in ("off", ""):
    return None
  if value != "auto":
    return value
  from jaxtier.common import cache_dirs  # pylint: disable=g-import-not-at-top
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dirs.cache_dir(), "xla")


def llm_kwargs() -> dict[str, Any]:
  """The engine flags as keyword arguments of `jaxtier.LLM` (the model included, as `model`)."""
  kwargs = {name: FLAGS[name].value for name in ENGINE_FLAGS}
  for name, low, high in (("offload_tail_layers", 0, None),
                          ("prefetch_depth", 1, engine_args.MAX_PREFETCH_DEPTH)):
    kwargs[name] = engine_args.int_or_auto(name, kwargs[name], low, high)
  return kwargs
