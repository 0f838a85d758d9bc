"""Which paged attention implementation a pool runs, and which one each call takes.

`resolve_attention_impl` turns `attention_impl` ("auto" included) into the implementation a pool
on a mesh runs; `attention_path` picks, per call, that implementation or the XLA path its platform
runs where the kernel does not serve the call (a sliding window, a soft cap, a shape); `attend`
runs the chosen path. Every implementation takes the same arguments (see `jaxtier.attention`).
"""

import jax

from jaxtier.attention import pallas_gpu
from jaxtier.attention.cpu_kernel import paged_attention_cpu
from jaxtier.attention.names import GPU_PLATFORMS
from jaxtier.attention.pallas_tpu import paged_attention_tpu, tpu_kernel_fits
from jaxtier.attention.reference import paged_attention_reference
from jaxtier.attention.xla_chunked import paged_attention
from jaxtier.attention.xla_gathered import paged_attention_gathered
from jaxtier.kernels.cpu import library as cpu_kernels


def resolve_attention_impl(impl: str, mesh: jax.sharding.Mesh, platform: str | None = None
                           ) -> str:
  """The attention path a pool on `mesh` runs; "auto" picks the platform's kernel where it applies.

  The kernels are custom calls XLA cannot split, so they serve pools on one device: "auto" is
  "cpu" on one CPU device (where the C++ kernels build), "pallas" on one GPU, "pallas_tpu" on
  one TPU, and the platform's XLA path otherwise; "xla" is the chunked loop on CPU and
  "xla_gathered" on an accelerator (whose launches make the loop's small steps slow). Asking
  for "cpu" where it cannot run, for "pallas" off a GPU or "pallas_tpu" off a TPU, is a
  ValueError. `platform`: the platform the program runs on, where it is not the mesh's (a
  program exported for another platform).
  """
  platform = platform or mesh.devices.flat[0].platform
  platform = "gpu" if platform in GPU_PLATFORMS else platform
  if impl == "pallas" and platform != "gpu":
    raise ValueError(f"attention_impl='pallas' needs a GPU, got a {platform} device "
                     "(use 'pallas_interpret' to run the kernel on CPU)")
  if impl == "pallas_tpu" and platform != "tpu":
    raise ValueError(f"attention_impl='pallas_tpu' needs a TPU, got a {platform} device "
                     "(use 'pallas_tpu_interpret' to run the kernel on CPU)")
  one = mesh.devices.size == 1
  if impl == "xla" or (impl == "auto" and platform != "cpu" and not one):
    return "xla" if platform == "cpu" else "xla_gathered"
  if impl == "auto" and platform in ("gpu", "tpu"):
    return "pallas" if platform == "gpu" else "pallas_tpu"
  if impl not in ("auto", "cpu"):
    return impl
  fits = platform == "cpu" and one
  if impl == "auto":
    return "cpu" if fits and cpu_kernels.available() else "xla"
  if not fits:
    raise ValueError(f"attention_impl='cpu' needs a pool on one CPU device, got "
                     f"{mesh.devices.size} {platform} device(s)")
  if not cpu_kernels.available():
    raise ValueError(f"attention_impl='cpu' is unavailable: {cpu_kernels.unavailable_reason()}")
  return impl


def attention_path(impl: str, t: int, head_dim: int, block_size: int, quantized: bool,
                   window: bool, cap: bool) -> str:
  """The implementation a call of `attend` runs under a resolved `impl`: `impl` itself where it
  serves the call, else the XLA path its platform runs. t: query tokens per row; window, cap:
  whether the layer has a sliding window, a soft cap.

  The CPU and GPU kernels take neither window nor cap ("cpu" falls back to the chunked "xla",
  the GPU kernel to "xla_gathered"); the GPU kernel serves the shapes `paged_attention_gpu.
  supports` (power-of-two block sizes), decode and prefill; the TPU kernel takes a cap, and
  serves decode steps where `tpu_kernel_fits`. The interpret impls follow their kernel's rules,
  so a CPU runs what the accelerator would.
  """
  if impl in ("reference", "xla", "xla_gathered"):
    return impl
  if impl == "cpu":
    return "xla" if window or cap else impl
  if impl in ("pallas", "pallas_interpret"):
    fits = pallas_gpu.supports(head_dim, block_size)
    return impl if fits and not window and not cap else "xla_gathered"
  if impl in ("pallas_tpu", "pallas_tpu_interpret"):
    fits = tpu_kernel_fits(t, head_dim, block_size, quantized)
    return impl if fits and not window else "xla_gathered"
  raise ValueError(f"attention_impl={impl!r} is not resolved (see resolve_attention_impl)")


def attend(path: str, q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
           v_scales_kfc=None, window=None, cap=None) -> jax.Array:
  """Paged attention by the implementation `path` (`attention_path`'s); output [b, t, n, d]."""
  args = (q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc, v_scales_kfc)
  if path == "reference":
    return paged_attention_reference(*args, window, cap)
  if path == "xla":
    return paged_attention(*args, window, cap)
  if path == "xla_gathered":
    return paged_attention_gathered(*args, window, cap)
  if path == "cpu":
    return paged_attention_cpu(*args)
  if path.startswith("pallas_tpu"):
    return paged_attention_tpu(*args, cap, interpret=path == "pallas_tpu_interpret")
  return pallas_gpu.paged_attention_gpu(*args, interpret=path == "pallas_interpret")
