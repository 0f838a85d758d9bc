"""Kernels of jaxtier's own. `cpu/`: C++ kernels for the CPU (packed and block-quantized matmuls,
paged attention, argmax), compiled on first use and called through the XLA FFI. The Pallas GPU
and TPU paged attention kernels are attention implementations, in `jaxtier.attention`."""
