"""The import graph of `jaxtier`: every arrow points down the layers, and there are no cycles.

Each module gets a layer from `LAYER_OF` (the longest dotted prefix with an entry wins, so a new
module inside a package inherits the package's layer; a new top-level module has no entry and fails
`test_every_module_has_a_layer` until one is added). Every import is an arrow, at module level or
inside a function alike; an arrow may point to the same layer or a lower one, never a higher one,
and the arrows between modules must form no cycle. A deliberate exception goes in `ALLOWED`, with
the reason in one line.

The layers, from the bottom:

- leaf: standard-library-only modules and plain data: `jaxtier.common` (argument checks, KV byte
  sizes, buckets, the cache directory, value sets), the model config, rotary tables, soft caps,
  the expert MLP, log-probability types, attention implementation names, the batch job's files,
  the allocator setting, and the doctor's symptom table (`LLM.doctor()` reads it).
- kernels: the CPU kernels and what is built straight on them or on the config alone: the packed
  matmul, compact weights, sharding rules, the tokenizer and detokenizer, the samplers, the
  grammar matchers of structured outputs, the result types.
- model: the Flax decoder.
- attention: the paged attention implementations and their dispatch (`jaxtier.attention`).
- state: the KV caches and the pure-Python scheduler.
- offload: tail-layer placement, the prefetching scan, the planner.
- checkpoint: loading weights (it places offloaded layers as it loads).
- driver: the reference driver (`engine.padded`) and the engine's arguments, each over the layers
  above.
- engine: the engine package: sizing and the plan, the step loop, its programs and statistics.
- api: `jaxtier.LLM`.
- top: the batch job's logic, the HTTP server and the tools, which may import anything; nothing
  below imports them.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxtier"

LAYERS = ("leaf", "kernels", "model", "attention", "state", "offload", "checkpoint", "driver",
          "engine", "api", "top")

# Module (or package, covering its submodules) -> layer name.
LAYER_OF = {
    # The root package's names load lazily (jaxtier.LLM, jaxtier.SamplingParams): importing a
    # name from it reaches `llm`, so only the top may. Matched exactly, not as a prefix.
    "jaxtier": "top",
    "jaxtier.common": "leaf",
    "jaxtier.model.config": "leaf",
    "jaxtier.model.rotary": "leaf",
    "jaxtier.model.softcap": "leaf",
    "jaxtier.model.moe": "leaf",
    "jaxtier.sampling.logprobs": "leaf",
    "jaxtier.attention.names": "leaf",
    "jaxtier.batch.reader": "leaf",
    "jaxtier.batch.files": "leaf",
    "jaxtier.kernels.cpu.heap": "leaf",
    "jaxtier.engine.doctor": "leaf",  # imports nothing of jaxtier; `LLM.doctor()` uses it
    "jaxtier.kernels": "kernels",
    "jaxtier.model.quant": "kernels",
    "jaxtier.model.sharding": "kernels",
    "jaxtier.text": "kernels",
    "jaxtier.sampling": "kernels",
    "jaxtier.engine.outputs": "kernels",
    "jaxtier.model": "model",
    "jaxtier.attention": "attention",
    "jaxtier.kvcache": "state",
    "jaxtier.scheduler": "state",
    "jaxtier.offload": "offload",
    "jaxtier.checkpoint": "checkpoint",
    "jaxtier.engine.padded": "driver",
    "jaxtier.engine.args": "driver",
    "jaxtier.engine": "engine",
    "jaxtier.llm": "api",
    "jaxtier.batch": "top",
    "jaxtier.server": "top",
    "jaxtier.tools": "top",
}

# (importer, imported) -> why an arrow that breaks the rule is there. Empty: none does.
ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py file of the package."""
  modules = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _resolve(name: str, modules) -> str | None:
  """The module a dotted import name lands in: itself, or the nearest enclosing module (a name
  imported from a module, such as `jaxtier.sampling.SamplingParams`, is that module)."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str, path: pathlib.Path, modules) -> dict[str, int]:
  """The jaxtier modules `module` imports (anywhere in the file) -> the line of the first."""
  is_package = path.name == "__init__.py"
  package = module if is_package else module.rpartition(".")[0]
  found = {}
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
      names = [f"{base}.{alias.name}" for alias in node.names]
    else:
      continue
    for name in names:
      if name.split(".")[0] != "jaxtier":
        continue
      target = _resolve(name, modules)
      if target is not None and target != module:
        found.setdefault(target, node.lineno)
  return found


def _layer(module: str) -> str | None:
  """The layer of the longest entry of LAYER_OF that is `module` or a package above it."""
  if module == "jaxtier":
    return LAYER_OF["jaxtier"]
  name = module
  while name != "jaxtier":
    if name in LAYER_OF:
      return LAYER_OF[name]
    name = name.rpartition(".")[0]
  return None


def _graph() -> dict[str, dict[str, int]]:
  modules = _modules()
  return {m: _imports(m, path, modules) for m, path in modules.items()}


def test_every_module_has_a_layer():
  missing = [m for m in _modules() if _layer(m) is None]
  assert not missing, (f"modules with no layer: {missing}; add them to LAYER_OF in "
                       f"tests/test_import_graph.py (the lowest layer above everything they "
                       f"import)")


def test_every_layer_entry_names_a_module():
  modules = _modules()
  assert set(LAYER_OF.values()) <= set(LAYERS)
  stale = [name for name in LAYER_OF
           if not any(m == name or m.startswith(name + ".") for m in modules)]
  assert not stale, f"LAYER_OF names modules that no longer exist: {stale}; remove or rename them"


def test_no_import_points_to_a_higher_layer():
  modules = _modules()
  upward = []
  for module, targets in _graph().items():
    for target, line in targets.items():
      if (module, target) in ALLOWED:
        continue
      low, high = _layer(module), _layer(target)
      if low is None or high is None:
        continue  # reported by test_every_module_has_a_layer
      if LAYERS.index(high) > LAYERS.index(low):
        upward.append(f"{modules[module].relative_to(PACKAGE.parent)}:{line}: {module} ({low}) "
                      f"imports {target} ({high})")
  assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_allowed_exceptions_are_still_imports():
  graph = _graph()
  stale = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], {})]
  assert not stale, f"ALLOWED lists imports that are gone: {stale}; remove them"


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
  """One cycle of `graph` (its modules in order, the first repeated at the end), or None.

  Depth-first search with three colours: a module on the current path (grey) reached again
  closes a cycle; a finished module (black) is not searched twice.
  """
  grey, black = set(), set()
  path: list[str] = []

  def visit(module: str) -> list[str] | None:
    grey.add(module)
    path.append(module)
    for target in sorted(graph.get(module, {})):
      if target in grey:
        return path[path.index(target):] + [target]
      if target not in black:
        found = visit(target)
        if found:
          return found
    grey.discard(module)
    black.add(module)
    path.pop()
    return None

  for module in sorted(graph):
    if module not in black:
      found = visit(module)
      if found:
        return found
  return None


def test_no_import_cycles():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_search_finds_a_cycle_and_accepts_a_dag():
  assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) is None
  assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b": 1, "c": 1}, "b": {"c": 1}, "c": {"c2": 1}, "c2": {"c": 1}}) == \
      ["c", "c2", "c"]


def test_nothing_below_the_api_imports_tools():
  below = LAYERS[:LAYERS.index("api")]
  found = [f"{module} imports {target}" for module, targets in _graph().items()
           for target in targets
           if target.startswith("jaxtier.tools") and _layer(module) in below]
  assert not found, "modules below jaxtier.llm import jaxtier.tools:\n" + "\n".join(found)


MAX_TOP_LEVEL_ENTRIES = 16


def test_top_level_is_the_layers():
  """The package's top level shows the architecture: packages and a few modules, nothing loose."""
  entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
  assert len(entries) <= MAX_TOP_LEVEL_ENTRIES, (
      f"jaxtier/ holds {len(entries)} entries, more than {MAX_TOP_LEVEL_ENTRIES}: {entries}")


def test_module_base_names_are_unique():
  """No two modules share a base name (`__init__.py` aside), so a name says which module it is."""
  by_name: dict[str, list[str]] = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.name != "__init__.py":
      by_name.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE.parent)))
  shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
  assert not shared, f"modules sharing a base name: {shared}"
