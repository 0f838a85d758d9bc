"""The CPU kernels: C++ sources compiled on first use into one library whose XLA FFI targets are
registered (`library`), the packed and block-quantized weights they multiply with einsum
references (`matmul`), and the glibc setting that keeps XLA:CPU's temporaries mapped
(`heap`). The paged attention kernels' wrapper is `jaxtier.attention.cpu_kernel`.

Submodules load on import only: `heap` needs the standard library alone.
"""
