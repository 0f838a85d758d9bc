"""Paged attention: queries attend to keys and values stored in fixed-size blocks of a shared pool.

Pages hold float32, bfloat16, uint16 (bfloat16 bit patterns, how the cache stores bfloat16 on CPU)
or int8 values with float32 scales per token and kv head (`page_format`). One module per
implementation, one signature; `dispatch` picks one per call (`dispatch.attention_path`), and
`names` owns the implementations' names:

- `reference.paged_attention_reference`: every sequence gathered token by token into a dense
  [batch, slots] array, then `dense.dense_attention`. Obviously right; the test path.
- `xla_chunked.paged_attention`: the XLA path on CPU, an online-softmax loop over chunks of the
  block tables (`online_softmax`), rows grouped by length.
- `xla_gathered.paged_attention_gathered`: the XLA path on accelerators, one batched gather of
  every row's pages and one masked softmax.
- `pallas_gpu.paged_attention_gpu`: the Pallas Triton GPU kernel, decode steps and prefill rows,
  power-of-two block sizes; `interpret=True` runs it on CPU.
- `pallas_tpu.paged_attention_tpu`: JAX's Pallas TPU decode kernel, decode steps of float pools
  where `tpu_kernel_fits`.
- `cpu_kernel.paged_attention_cpu`: C++ kernels through the XLA FFI that read the pages in place.

The pool is addressed by flat page ids: the cache stores [kv_heads, layers, blocks, block_size,
head_dim] and views it as [kv_heads, layers * blocks, block_size, head_dim] (a free reshape), so
block `i` of layer `l` is page `l * blocks + i`. That is the kernels' native `k_pages` layout, which
lets every layer read the stacked pool without slicing a per-layer copy out of it.

Key slot `s` of a sequence is token position `s`: it lives in page `pages_bm[b, s // c]` at offset
`s % c`. A query at position `p` attends to slots `0..p`, or with a sliding `window` W to slots
`p - W + 1..p`; scores may be soft-capped (`cap`, Gemma 2). The reference and XLA paths take
`window` and `cap`, the TPU kernel `cap` only; the GPU and CPU kernels have neither, so such a
layer runs an XLA path. Negative positions are padding (output 0). Page ids below zero mark unused
table entries; they are never read for a visible slot.

Shape legend: b batch, t query tokens, n query heads, k kv heads, g = n // k, d head dim, f flat
pages (layers * blocks), c block size (slots per block), m blocks per sequence (table width),
s key slots (m * c, or one chunk's slots in the chunked path), x chunks of the chunked path's
scan, q query rows per kv head in the XLA paths (t * g, t major).

The names below load on first access, so `jaxtier.attention.names` imports no JAX.
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_EXPORTS = {
    "ATTENTION_IMPLS": "names", "ATTENTION_PATHS": "names", "GPU_PLATFORMS": "names",
    "dense_attention": "dense", "in_window": "dense",
    "KV_CACHE_DTYPES": "page_format", "SCALE_DTYPE": "page_format",
    "quantize_int8": "page_format", "dequantize_int8": "page_format",
    "check_paged_inputs": "reference", "paged_attention_reference": "reference",
    "paged_attention": "xla_chunked", "CHUNK_SLOTS": "xla_chunked", "ROW_GROUP": "xla_chunked",
    "GROUP_QUERIES": "xla_chunked",
    "paged_attention_gathered": "xla_gathered", "GATHER_SLOTS": "xla_gathered",
    "paged_attention_tpu": "pallas_tpu", "tpu_kernel_fits": "pallas_tpu",
    "TPU_LANES": "pallas_tpu", "TPU_SUBLANES": "pallas_tpu", "TPU_COMPUTE_SLOTS": "pallas_tpu",
    "paged_attention_gpu": "pallas_gpu",
    "paged_attention_cpu": "cpu_kernel",
    "attention_path": "dispatch", "resolve_attention_impl": "dispatch",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_names(
    __name__, {name: f"jaxtier.attention.{module}" for name, module in _EXPORTS.items()},
    globals())
