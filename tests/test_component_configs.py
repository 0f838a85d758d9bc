"""The inner configs take the engine arguments' names and leave their defaults to `EngineArgs`.

`jaxtier.engine.args.EngineArgs` is where an engine argument's name, default and range are
written. A component config (the scheduler's, the paged cache's, the engine's, the offload
planner's dataclasses) that holds one of those values names its field as the argument does and
gives it no default, so that a default cannot drift from the argument's; and none of them keeps
an old synonym of an argument.
"""

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

from jaxtier.engine.args import ARG_NAMES
from jaxtier.engine.engine import EngineConfig
from jaxtier.kvcache import PagedCacheConfig
import jaxtier.offload
from jaxtier.scheduler import SchedulerConfig

OLD_SYNONYMS = ("max_running", "max_tokens_per_step", "num_blocks", "host_pool_gib",
                "watermark_fraction", "swap_impl")
# Offload dataclasses that still give an engine argument a default (none at present): their
# cases are expected to fail until jaxtier.offload adopts the rule.
OFFLOAD_EXCEPTIONS: dict[str, str] = {}


def _offload_dataclasses() -> list[type]:
  """Every dataclass defined in a module of jaxtier.offload."""
  found = {}
  for info in pkgutil.iter_modules(jaxtier.offload.__path__, "jaxtier.offload."):
    module = importlib.import_module(info.name)
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__:
        found[f"{cls.__module__}.{cls.__qualname__}"] = cls
  return [found[name] for name in sorted(found)]


def _cases() -> list:
  cases = []
  for cls in [SchedulerConfig, PagedCacheConfig, EngineConfig] + _offload_dataclasses():
    name = f"{cls.__module__}.{cls.__qualname__}"
    marks = ()
    if name in OFFLOAD_EXCEPTIONS:
      marks = pytest.mark.xfail(strict=True, reason=OFFLOAD_EXCEPTIONS[name])
    cases.append(pytest.param(cls, id=name, marks=marks))
  return cases


def test_offload_has_dataclasses_to_check():
  names = {cls.__qualname__ for cls in _offload_dataclasses()}
  assert {"ModelBytes", "OffloadPlan"} <= names


@pytest.mark.parametrize("cls", _cases())
def test_engine_argument_fields_have_no_default(cls):
  defaulted = [f.name for f in dataclasses.fields(cls) if f.name in ARG_NAMES
               and (f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING)]
  assert not defaulted, (f"{cls.__qualname__} gives engine arguments {defaulted} a default: "
                         "EngineArgs holds their defaults")


@pytest.mark.parametrize("cls", _cases())
def test_no_old_synonym_of_an_engine_argument(cls):
  old = [f.name for f in dataclasses.fields(cls) if f.name in OLD_SYNONYMS]
  assert not old, f"{cls.__qualname__} has fields {old}: expected the EngineArgs names"


def test_the_components_take_the_engine_arguments_names():
  """The fields the engine fills from an engine argument carry that argument's name."""
  scheduler = {f.name for f in dataclasses.fields(SchedulerConfig)}
  assert {"block_size", "max_num_seqs", "max_num_batched_tokens", "watermark", "preemption_mode",
          "victim_policy", "enable_prefix_caching", "host_prefix_caching", "num_device_blocks",
          "num_host_blocks"} <= scheduler
  cache = {f.name for f in dataclasses.fields(PagedCacheConfig)}
  assert {"num_device_blocks", "num_host_blocks", "block_size", "kv_cache_dtype",
          "attention_impl"} <= cache
  assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(ARG_NAMES)


def _error(make) -> str | None:
  try:
    make()
  except ValueError as e:
    return str(e)
  return None


SCHEDULER = dict(num_device_blocks=64, num_host_blocks=16, block_size=16, max_num_seqs=8,
                 max_num_batched_tokens=64, watermark=0.01, preemption_mode="swap",
                 victim_policy="longest_waiting", enable_prefix_caching=True,
                 host_prefix_caching=True)
CACHE = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_device_blocks=64, block_size=16,
             num_host_blocks=16, kv_cache_dtype="float32", attention_impl="xla")
BAD = [("block_size", 0), ("block_size", 4096), ("max_num_seqs", 0), ("max_num_seqs", 10**5),
       ("max_num_batched_tokens", 4), ("watermark", 1.0), ("watermark", -0.1),
       ("preemption_mode", "drop"), ("enable_prefix_caching", 1), ("host_prefix_caching", "yes"),
       ("kv_cache_dtype", "float16"), ("attention_impl", "flash")]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_config_built_alone_checks_an_argument_as_the_engine_arguments_do(name, value):
  """The scheduler and the paged cache, built on their own (the simulator, a researcher's code),
  reject a bad value of an engine argument they hold as the engine arguments do (what is
  expected may differ: the engine's "auto", its defaults)."""
  from jaxtier.engine.args import EngineArgs  # pylint: disable=import-outside-toplevel
  named = lambda message: message.split(": expected")[0]
  expected = _error(lambda: EngineArgs(**{"max_num_seqs": 8} | {name: value}))
  assert expected is not None and named(expected) == f"{name}={value!r}"
  checked = 0
  for config, base in ((SchedulerConfig, SCHEDULER), (PagedCacheConfig, CACHE)):
    if name in base:
      got = _error(lambda config=config, base=base: config(**base | {name: value}))
      assert got is not None and named(got) == named(expected), (config.__name__, got)
      checked += 1
  assert checked
