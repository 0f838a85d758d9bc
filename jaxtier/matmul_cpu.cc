// x @ w for XLA:CPU with w packed in column panels, called through the XLA FFI (see
// jaxtier/matmul.py for the layout and jaxtier/cpu_kernels.py for the build).
//
// The packed weight is [N / 64, K, 64]: panel p holds columns [64 p, 64 p + 64) of the [K, N]
// matrix, row by row, so a panel is one contiguous stream. An item is (panel, block of up to 96
// rows of x); for every tile of up to 6 rows it keeps 6 x 64 sums in registers while it walks the
// panel's K rows once. At decode (a few rows) each weight is read once from memory in order,
// which XLA:CPU's skinny matmuls do not manage; at prefill the panel stays in the core's L2 cache
// across the row tiles. Items are pulled from an atomic counter by the calling
// thread and by the kernels' crew of helper threads (jaxtier/cpu_crew.h).
//
// x is float32 [M, K] (row-major), out float32 [M, N]. A second handler applies an RMS norm to
// x's rows first (the pre-norm of a decoder layer's q/k/v and gate/up projections).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_crew.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;     // columns per panel: 4 vectors of 16 floats
constexpr int64_t kRowBlock = 96;  // rows of x per work item
constexpr int kTile = 6;           // rows per register tile: 6 x 4 accumulators

using jaxtier::LoadV;
using jaxtier::StoreV;
using jaxtier::V16;

// out[R rows, 64 columns] (row stride n) = x[R rows, K] (row stride k) @ panel [K, 64].
// No software prefetch: the panel is one sequential stream, which the hardware prefetcher follows
// best on its own. Prefetching one line per panel row (a quarter of the 256-byte row) cost 10-25%
// of the streaming rate at 1-32 rows in a two-thread test on a Zen 4 CPU.
template <int R>
inline void Tile(const float* x, const float* panel, float* out, int64_t k, int64_t n) {
  V16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = V16{};
  const float* w = panel;
  for (int64_t i = 0; i < k; ++i, w += kPanel) {
    V16 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = LoadV(w + 16 * j);
    for (int r = 0; r < R; ++r) {
      const V16 xv = V16{} + x[r * k + i];
      for (int j = 0; j < 4; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) StoreV(out + r * n + 16 * j, acc[r][j]);
}

struct Call : jaxtier::Job {
  const float* x;
  const float* w;
  float* out;
  int64_t m, k, n, row_blocks;
  std::vector<float> normed;  // the normalized x of a norm-and-multiply call
  void RunItem(int64_t item) override;
};

void Call::RunItem(int64_t item) {
  const int64_t p = item / row_blocks;
  const int64_t first = (item % row_blocks) * kRowBlock;
  const int64_t last = std::min(m, first + kRowBlock);
  const float* panel = w + p * k * kPanel;
  int64_t r = first;
  for (; r + kTile <= last; r += kTile)
    Tile<kTile>(x + r * k, panel, out + r * n + p * kPanel, k, n);
  const float* rest = x + r * k;  // the last rows, fewer than a tile
  float* rest_out = out + r * n + p * kPanel;
  switch (last - r) {
    case 5: Tile<5>(rest, panel, rest_out, k, n); break;
    case 4: Tile<4>(rest, panel, rest_out, k, n); break;
    case 3: Tile<3>(rest, panel, rest_out, k, n); break;
    case 2: Tile<2>(rest, panel, rest_out, k, n); break;
    case 1: Tile<1>(rest, panel, rest_out, k, n); break;
    default: break;
  }
}

// Multiplies call->x [M, K] by w [N/64, K, 64] into out [M, N] (shapes checked by the caller).
ffi::Error Multiply(ffi::ThreadPool pool, std::shared_ptr<Call> call, int64_t panels) {
  if (call->m == 0 || call->n == 0) return ffi::Error::Success();
  if (call->k == 0) {
    std::memset(call->out, 0, sizeof(float) * call->m * call->n);
    return ffi::Error::Success();
  }
  call->row_blocks = (call->m + kRowBlock - 1) / kRowBlock;
  call->items = panels * call->row_blocks;
  // XLA's intra-op thread count caps the helpers, as it does XLA's own kernels.
  jaxtier::RunJob(call, std::min<int64_t>(pool.num_threads(), call->items - 1));
  return ffi::Error::Success();
}

using Dims = ffi::AnyBuffer::Dimensions;

bool Fits(const Dims& xd, const Dims& wd, const Dims& od) {
  return xd.size() == 2 && wd.size() == 3 && wd[2] == kPanel && wd[1] == xd[1] &&
         od.size() == 2 && od[0] == xd[0] && od[1] == wd[0] * kPanel;
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  if (!Fits(x.dimensions(), w.dimensions(), out->dimensions()))
    return ffi::Error::InvalidArgument("packed matmul: expected x [M, K], w [N/64, K, 64], "
                                       "out [M, N]");
  auto call = std::make_shared<Call>();
  call->x = x.typed_data();
  call->w = w.typed_data();
  call->out = out->typed_data();
  call->m = x.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = out->dimensions()[1];
  return Multiply(pool, call, w.dimensions()[0]);
}

// rms_norm(x) @ w, with rms_norm(x)[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * scale, float32,
// in the order jaxtier.model.RMSNorm computes it. The caller normalizes every row once into a
// buffer the call owns; all threads then multiply from it. This saves XLA two small ops per norm
// (a reduction and a multiply), which at 8-32 rows took 15-80 us each: longer than the math.
ffi::Error NormPackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> out, float eps) {
  if (!Fits(x.dimensions(), w.dimensions(), out->dimensions()) ||
      scale.dimensions().size() != 1 || scale.dimensions()[0] != x.dimensions()[1])
    return ffi::Error::InvalidArgument("norm packed matmul: expected x [M, K], scale [K], "
                                       "w [N/64, K, 64], out [M, N]");
  auto call = std::make_shared<Call>();
  call->m = x.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = out->dimensions()[1];
  call->normed.resize(call->m * call->k);
  const float* src = x.typed_data();
  const float* g = scale.typed_data();
  for (int64_t r = 0; r < call->m; ++r) {
    const float* row = src + r * call->k;
    float* dst = call->normed.data() + r * call->k;
    V16 lanes{};  // 16 partial sums of squares (XLA sums in its own order too)
    int64_t i = 0;
    for (; i + 16 <= call->k; i += 16) {
      const V16 v = LoadV(row + i);
      lanes += v * v;
    }
    float sum = jaxtier::Sum16(lanes);
    for (; i < call->k; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(call->k) + eps);
    for (int64_t i = 0; i < call->k; ++i) dst[i] = g[i] * (row[i] * inv);
  }
  call->x = call->normed.data();
  call->w = w.typed_data();
  call->out = out->typed_data();
  return Multiply(pool, call, w.dimensions()[0]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierNormPackedMatmul, NormPackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
