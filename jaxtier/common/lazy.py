"""Package names that load on first access (PEP 562), so that importing one light submodule of a
package does not import the package's heavy ones (JAX, fastapi)."""

from collections.abc import Callable, Mapping
from importlib import import_module


def lazy_names(package: str, names: Mapping[str, str], namespace: Mapping[str, object]
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
  """(`__getattr__`, `__dir__`) for `package`: `names` maps each public name to the module that
  defines it, imported when the name is first read; `dir()` lists those names and the public
  names of the package's own `namespace` (its `globals()`: the submodules imported so far)."""

  def getattr_(name: str):
    if name in names:
      return getattr(import_module(names[name]), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def dir_() -> list[str]:
    return sorted({n for n in namespace if not n.startswith("_")} | set(names))

  return getattr_, dir_
