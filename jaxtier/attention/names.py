"""The names of the paged attention implementations and paths: the one place they are written.

Standard library only, so that `jaxtier.engine.args` checks `attention_impl` before JAX loads.
"""

from jaxtier.common.choices import PLATFORM_ALIASES

# What a paged cache's `attention_impl` may name (`jaxtier.kvcache.PagedCacheConfig`); "auto" is
# resolved per platform by `jaxtier.attention.dispatch.resolve_attention_impl`.
ATTENTION_IMPLS = ("auto", "xla", "xla_gathered", "cpu", "reference", "pallas", "pallas_interpret",
                   "pallas_tpu", "pallas_tpu_interpret")
# The engine argument's choices: every implementation but the test path, "reference".
ENGINE_ATTENTION_IMPLS = tuple(name for name in ATTENTION_IMPLS if name != "reference")
# The paths a call runs (`dispatch.attention_path`; an interpret impl runs its kernel's path), as
# an exported program names them (`jaxtier.tools.export`).
ATTENTION_PATHS = ("pallas", "pallas_tpu", "cpu", "xla_gathered", "xla", "reference")
# JAX platform names of a GPU.
GPU_PLATFORMS = ("gpu",) + tuple(name for name, platform in PLATFORM_ALIASES.items()
                                 if platform == "gpu")
