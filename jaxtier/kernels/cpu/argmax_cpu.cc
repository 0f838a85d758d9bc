// Greedy decoding's argmax over each row of float32 logits, for XLA:CPU through the XLA FFI (see
// jaxtier/sampling.py for the reference, jaxtier/cpu_kernels.py for the build).
//
// XLA:CPU runs jaxtier.sampling.argmax's max and masked min as a select fusion and a reduction,
// two passes over the logits well short of the memory's rate. Here one pass per row keeps the
// lanes of the widest vector register (16 with AVX-512, 8 with AVX2) as (largest value, its first
// index): a later equal value never replaces an earlier one, so the smallest index among the
// lanes holding the maximum is the first index of the maximum. (Held as 16 lanes in two AVX2
// registers, the selects compiled to lane-by-lane code, no faster than XLA's.) Rows are the work
// items, shared with the kernels' crew of helper threads (jaxtier/cpu_crew.h). A row holding a
// NaN gives v - 1 (the reference does so for a row of NaNs).
//
// x is float32 [M, V], out int32 [M].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "cpu_crew.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = jaxtier::kNativeLanes;
using jaxtier::IN;
using jaxtier::LoadN;
using jaxtier::VN;

int32_t RowArgmax(const float* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  bool nan = false;
  int64_t i = 0;
  if (v >= kLanes) {
    VN lane_best = LoadN(row);
    IN lane_at, index;
    for (int l = 0; l < kLanes; ++l) lane_at[l] = index[l] = l;
    IN lane_nan = lane_best != lane_best;
    for (i = kLanes; i + kLanes <= v; i += kLanes) {
      const VN x = LoadN(row + i);
      index += kLanes;
      const IN greater = x > lane_best;
      lane_best = greater ? x : lane_best;
      lane_at = greater ? index : lane_at;
      lane_nan |= x != x;
    }
    best = lane_best[0];
    at = lane_at[0];
    for (int l = 0; l < kLanes; ++l) {
      nan |= lane_nan[l] != 0;
      if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < at)) {
        best = lane_best[l];
        at = lane_at[l];
      }
    }
  } else if (v > 0) {
    best = row[0];
    nan = std::isnan(row[0]);
    i = 1;
  }
  for (; i < v; ++i) {
    nan |= std::isnan(row[i]);
    if (row[i] > best) {
      best = row[i];
      at = i;
    }
  }
  return static_cast<int32_t>(nan ? v - 1 : at);
}

struct Call : jaxtier::Job {
  const float* x;
  int32_t* out;
  int64_t v;
  void RunItem(int64_t row) override { out[row] = RowArgmax(x + row * v, v); }
};

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 1 || od[0] != xd[0] || xd[1] == 0)
    return ffi::Error::InvalidArgument("argmax: expected x [M, V > 0] and out [M]");
  auto call = std::make_shared<Call>();
  call->x = x.typed_data();
  call->out = out->typed_data();
  call->items = xd[0];
  call->v = xd[1];
  if (call->items == 0) return ffi::Error::Success();
  jaxtier::RunJob(call, std::min<int64_t>(pool.num_threads(), call->items - 1));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
