// Paged attention for XLA:CPU, called through the XLA FFI (see jaxtier/cpu_kernels.py): decode
// steps here, prefill rows (several query tokens per row) further down.
//
// Decode: one query token per sequence attends to the slots 0..pos of its block table, read in
// place from the pool: no gathered copy of the context is made. Work items are (sequence, kv head)
// pairs, pulled from an atomic counter by the calling thread and by the kernels' crew of helper
// threads (jaxtier/cpu_crew.h). Each item runs two passes: scores q.k for every visible slot (kept
// in a per-thread buffer), then the softmax and sum of p * v, so each key and value is read once
// from memory.
//
// Pages are [kv_heads, pages, block_size, head_dim] of float32, uint16 (bfloat16 bit patterns) or
// int8 with float32 scales [kv_heads, pages, block_size] (one per token and kv head). The query is
// float32 [batch, heads, head_dim], already scaled by head_dim ** -0.5; heads are kv-head major
// (head h reads kv head h / (heads / kv_heads)). A negative position gives zeros.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_crew.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // partial sums of the generic loop's dot products

using jaxtier::IN;
using jaxtier::LoadN;
using jaxtier::StoreN;
using jaxtier::V16;
using jaxtier::VN;

constexpr int kNL = jaxtier::kNativeLanes;  // lanes of the widest register (VN)

// The sum of a vector's lanes by halves (a scalar loop over the lanes is a chain of 15 dependent
// adds per score).
typedef float F4 __attribute__((vector_size(16)));
typedef float F8 __attribute__((vector_size(32)));
inline float Reduce(F4 v) {
  const F4 s = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
  return (s + __builtin_shufflevector(s, s, 1, 0, 3, 2))[0];
}
inline float Reduce(F8 v) {
  return Reduce(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
                __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
inline float Reduce(V16 v) {
  return Reduce(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// Softmax numerators of row[0..n) in place: exp(row - max(row)); returns their sum. In vectors of
// the widest register: 16-lane selects held in two AVX2 registers compile to lane-by-lane code.
inline float SoftmaxInPlace(float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kNL) {
    VN m = LoadN(row);
    for (i = kNL; i + kNL <= n; i += kNL) {
      const VN v = LoadN(row + i);
      m = v > m ? v : m;
    }
    for (int l = 0; l < kNL; ++l) mx = std::max(mx, m[l]);
  }
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  VN lanes{};
  for (i = 0; i + kNL <= n; i += kNL) {
    const VN e = jaxtier::Exp(LoadN(row + i) - mx);
    StoreN(row + i, e);
    lanes += e;
  }
  float total = Reduce(lanes);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - mx);
    total += row[i];
  }
  return total;
}

inline float Load(float x) { return x; }
inline float Load(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float Load(int8_t x) { return static_cast<float>(x); }

// Dot of a float query row with one stored key row; lanes keep the sum vectorizable without
// reassociating a single accumulator.
template <typename T>
inline float Dot(const float* q, const T* k, int64_t d) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += q[i + l] * Load(k[i + l]);
  }
  float sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (; i < d; ++i) sum += q[i] * Load(k[i]);
  return sum;
}

// Prefetches the cache lines of one row of d values.
template <typename T>
inline void Prefetch(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < d * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(p + i);
}

template <typename T>
inline void Axpy(float a, const T* v, float* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += a * Load(v[i]);
}

template <typename A, typename B>
bool SameDims(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Pages ahead that ForEachSlot prefetches: two read keys and values faster than one (the page
// after next is in flight while this one is read).
constexpr int64_t kPrefetchPages = 2;

// Calls fn(slot, row, scale) for slots 0..slots-1 of one kv head, in order: `row` is the slot's
// d values in `pool`, `scale` its int8 scale (1 without scales). Pages are scattered over the
// pool, which defeats the hardware prefetcher at every page start, so each slot's step also
// prefetches its row of the page kPrefetchPages ahead.
template <typename T, typename Fn>
inline void ForEachSlot(const int32_t* table, int64_t head_base, int64_t slots, int64_t c,
                        int64_t d, const T* pool, const float* scales, Fn&& fn) {
  for (int64_t start = 0; start < slots; start += c) {
    const int64_t page = head_base + table[start / c];
    const int64_t n = std::min(c, slots - start);
    const T* rows = pool + page * c * d;
    const int64_t ahead = start + kPrefetchPages * c;
    const T* next = ahead < slots ? pool + (head_base + table[ahead / c]) * c * d : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      if (next) Prefetch(next + j * d, d);
      fn(start + j, rows + j * d, scales ? scales[page * c + j] : 1.0f);
    }
  }
}

struct Shape {
  int64_t batch, heads, kv_heads, group, head_dim, pages, block_size, table_width;
};

// Attention of one sequence's queries for one kv head (`group` query heads).
template <typename T>
void AttendItem(const Shape& s, int64_t b, int64_t kvh, const float* q, const T* k, const T* v,
                const int32_t* tables, const int32_t* pos, const float* k_scales,
                const float* v_scales, float* out, std::vector<float>& scores) {
  const int64_t g = s.group, d = s.head_dim, c = s.block_size;
  const float* q_b = q + (b * s.heads + kvh * g) * d;
  float* out_b = out + (b * s.heads + kvh * g) * d;
  std::fill(out_b, out_b + g * d, 0.0f);
  const int64_t slots = std::min<int64_t>(static_cast<int64_t>(pos[b]) + 1, s.table_width * c);
  if (slots <= 0) return;
  scores.resize(g * slots + g);  // scores [g, slots], then each head's softmax sum
  float* sum_h = scores.data() + g * slots;
  const int32_t* table = tables + b * s.table_width;
  const int64_t head_base = kvh * s.pages;
  // Pass 1: scores [g, slots].
  ForEachSlot(table, head_base, slots, c, d, k, k_scales,
              [&](int64_t slot, const T* key, float scale) {
                for (int64_t h = 0; h < g; ++h) {
                  scores[h * slots + slot] = Dot(q_b + h * d, key, d) * scale;
                }
              });
  // Softmax per query head.
  for (int64_t h = 0; h < g; ++h) sum_h[h] = SoftmaxInPlace(scores.data() + h * slots, slots);
  // Pass 2: out[h] = sum_i p[h, i] * v[i].
  ForEachSlot(table, head_base, slots, c, d, v, v_scales,
              [&](int64_t slot, const T* value, float scale) {
                for (int64_t h = 0; h < g; ++h) {
                  Axpy(scores[h * slots + slot] * scale, value, out_b + h * d, d);
                }
              });
  for (int64_t h = 0; h < g; ++h) {
    const float inv = 1.0f / sum_h[h];
    for (int64_t i = 0; i < d; ++i) out_b[h * d + i] *= inv;
  }
}

// kNL stored values as floats.
typedef uint16_t UN __attribute__((vector_size(2 * kNL)));
typedef int8_t BN __attribute__((vector_size(kNL)));
inline VN LoadAsN(const float* p) { return LoadN(p); }
inline VN LoadAsN(const uint16_t* p) {  // bfloat16 bits: the high half of a float32
  UN u;
  std::memcpy(&u, p, sizeof(u));
  const IN bits = __builtin_convertvector(u, IN) << 16;
  VN out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline VN LoadAsN(const int8_t* p) {
  BN u;
  std::memcpy(&u, p, sizeof(u));
  return __builtin_convertvector(u, VN);
}

// AttendItem for G query heads per kv head and head_dim = kNL x DV, in vectors of the widest
// register: each key and value row is loaded once for all G heads, every score takes one lane
// sum, and pass 2 accumulates the G x DV outputs without storing them per slot. With AVX-512
// (DV 4 at d 64) the queries and sums stay in registers, faster than the generic loop over
// contiguous pages. With AVX2's 16 registers (DV 8)
// the compiler keeps part of them on the stack; splitting pass 2 into column chunks that fit
// was slower (more passes over the slots) than those spills.
template <typename T, int G, int DV>
void AttendItemHeld(const Shape& s, int64_t b, int64_t kvh, const float* q, const T* k,
                    const T* v, const int32_t* tables, const int32_t* pos,
                    const float* k_scales, const float* v_scales, float* out,
                    std::vector<float>& scores) {
  const int64_t d = s.head_dim, c = s.block_size;
  const float* q_b = q + (b * s.heads + kvh * G) * d;
  float* out_b = out + (b * s.heads + kvh * G) * d;
  const int64_t slots = std::min<int64_t>(static_cast<int64_t>(pos[b]) + 1, s.table_width * c);
  if (slots <= 0) {
    std::fill(out_b, out_b + G * d, 0.0f);
    return;
  }
  scores.resize(G * slots);
  float* sc = scores.data();
  const int32_t* table = tables + b * s.table_width;
  const int64_t head_base = kvh * s.pages;
  VN qv[G][DV];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < DV; ++j) qv[h][j] = LoadN(q_b + h * d + kNL * j);
  ForEachSlot(table, head_base, slots, c, d, k, k_scales,
              [&](int64_t slot, const T* key, float scale) {
                VN kv[DV];
                for (int j = 0; j < DV; ++j) kv[j] = LoadAsN(key + kNL * j);
                for (int h = 0; h < G; ++h) {
                  VN acc = qv[h][0] * kv[0];
                  for (int j = 1; j < DV; ++j) acc += qv[h][j] * kv[j];
                  sc[h * slots + slot] = Reduce(acc) * scale;
                }
              });
  float total[G];
  for (int h = 0; h < G; ++h) total[h] = SoftmaxInPlace(sc + h * slots, slots);
  VN acc[G][DV] = {};
  ForEachSlot(table, head_base, slots, c, d, v, v_scales,
              [&](int64_t slot, const T* value, float scale) {
                VN vv[DV];
                for (int j = 0; j < DV; ++j) vv[j] = LoadAsN(value + kNL * j);
                for (int h = 0; h < G; ++h) {
                  const float p = sc[h * slots + slot] * scale;
                  for (int j = 0; j < DV; ++j) acc[h][j] += p * vv[j];
                }
              });
  for (int h = 0; h < G; ++h) {
    const float inv = 1.0f / total[h];
    for (int j = 0; j < DV; ++j) StoreN(out_b + h * d + kNL * j, acc[h][j] * inv);
  }
}

template <typename T>
using AttendFn = void (*)(const Shape&, int64_t, int64_t, const float*, const T*, const T*,
                          const int32_t*, const int32_t*, const float*, const float*, float*,
                          std::vector<float>&);

template <typename T, int DV>
AttendFn<T> HeldFor(int64_t g) {
  switch (g) {
    case 1: return AttendItemHeld<T, 1, DV>;
    case 2: return AttendItemHeld<T, 2, DV>;
    case 3: return AttendItemHeld<T, 3, DV>;
    case 4: return AttendItemHeld<T, 4, DV>;
    case 5: return AttendItemHeld<T, 5, DV>;
    case 6: return AttendItemHeld<T, 6, DV>;
    case 7: return AttendItemHeld<T, 7, DV>;
    case 8: return AttendItemHeld<T, 8, DV>;
    default: return AttendItem<T>;
  }
}

// The register-held loop for head_dim 64 or 128 and up to 8 query heads per kv head, else the
// generic one.
template <typename T>
AttendFn<T> AttendFor(const Shape& s) {
  if (s.head_dim == 64) return HeldFor<T, 64 / kNL>(s.group);
  if (s.head_dim == 128) return HeldFor<T, 128 / kNL>(s.group);
  return AttendItem<T>;
}

// What both kernels read and write besides their queries: the pools (of the element type the call
// dispatches on), tables, positions, int8 scales (null without) and the output.
struct PoolArgs {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* pos;
  const float* k_scales;
  const float* v_scales;
  float* out;
};

// Checks the pools against each other ([k, f, c, d], same element type), the int8 scales against
// them ([k, f, c]) and every table entry against the f pages, then fills `args`.
ffi::Error UnpackPool(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> pos,
                      ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                      ffi::ResultBuffer<ffi::F32>& out, PoolArgs& args) {
  const auto kd = k_pages.dimensions();
  if (kd.size() != 4 || kd[0] == 0 || !SameDims(v_pages.dimensions(), kd) ||
      v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("k and v pages must both be [k, f, c, d] of one type");
  }
  const bool quantized = k_pages.element_type() == ffi::DataType::S8;
  const int64_t scale_count = kd[0] * kd[1] * kd[2];
  if (quantized && (static_cast<int64_t>(k_scales.element_count()) != scale_count ||
                    static_cast<int64_t>(v_scales.element_count()) != scale_count)) {
    return ffi::Error::InvalidArgument("int8 pages need scales [k, f, c]");
  }
  const int32_t* t = tables.typed_data();
  for (size_t i = 0; i < tables.element_count(); ++i) {
    if (t[i] < 0 || t[i] >= kd[1]) return ffi::Error::InvalidArgument("page id outside the pool");
  }
  args = {q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), t, pos.typed_data(),
          quantized ? k_scales.typed_data() : nullptr,
          quantized ? v_scales.typed_data() : nullptr, out->typed_data()};
  return ffi::Error::Success();
}

// run(T{}) for the pages' element type T: float32, uint16 (bfloat16 bits) or int8.
template <typename Run>
ffi::Error ByPageType(ffi::DataType type, Run&& run) {
  switch (type) {
    case ffi::DataType::F32:
      return run(float{});
    case ffi::DataType::U16:
      return run(uint16_t{});
    case ffi::DataType::S8:
      return run(int8_t{});
    default:
      return ffi::Error::InvalidArgument("pages must be float32, uint16 (bfloat16 bits) or int8");
  }
}

// One call's arguments and its work counter. Helpers hold it by shared_ptr, so a helper that
// starts after the call returned finds no work left and touches nothing else.
struct Call : jaxtier::Job, PoolArgs {
  Shape s;
  void (*attend_item)(const Call&, int64_t) = nullptr;  // AttendOne<T> for the pool's type
  void RunItem(int64_t item) override { attend_item(*this, item); }
};

// Item (sequence, kv head) = (item / kv_heads, item % kv_heads) of a call on T pages.
template <typename T>
void AttendOne(const Call& call, int64_t item) {
  thread_local std::vector<float> scores;
  AttendFor<T>(call.s)(call.s, item / call.s.kv_heads, item % call.s.kv_heads, call.q,
                       static_cast<const T*>(call.k), static_cast<const T*>(call.v), call.tables,
                       call.pos, call.k_scales, call.v_scales, call.out, scores);
}

template <typename T>
ffi::Error Run(ffi::ThreadPool pool, std::shared_ptr<Call> call) {
  const Shape& s = call->s;
  call->items = s.batch * s.kv_heads;
  call->attend_item = AttendOne<T>;
  // Small steps are not worth a helper's start-up: under 256 visible slot-heads a call takes a
  // few microseconds, about what waking the helper costs.
  int64_t visible = 0;
  for (int64_t b = 0; b < s.batch; ++b) visible += std::max<int32_t>(call->pos[b] + 1, 0);
  const int64_t helpers =
      visible * s.kv_heads < 256 ? 0 : std::min<int64_t>(pool.num_threads(), call->items - 1);
  jaxtier::RunJob(call, helpers);
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> pos,
                                    ffi::Buffer<ffi::F32> k_scales,
                                    ffi::Buffer<ffi::F32> v_scales,
                                    ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("q [b, n, d], pages [k, f, c, d], tables [b, m] expected");
  }
  Shape s{qd[0], qd[1], kd[0], 0, qd[2], kd[1], kd[2], td[1]};
  auto call = std::make_shared<Call>();
  if (ffi::Error error = UnpackPool(q, k_pages, v_pages, tables, pos, k_scales, v_scales, out,
                                    *call);
      error.failure()) {
    return error;
  }
  if (s.heads % s.kv_heads || kd[3] != s.head_dim || td[0] != s.batch ||
      static_cast<int64_t>(pos.element_count()) != s.batch) {
    return ffi::Error::InvalidArgument("paged attention arguments do not fit together");
  }
  s.group = s.heads / s.kv_heads;
  call->s = s;
  return ByPageType(k_pages.element_type(),
                    [&](auto page) { return Run<decltype(page)>(pool, call); });
}


// Decode with the new token's write: each row's new key and value (in the pool's storage type)
// go into slot pos % c of page tables[b, pos / c] + offset, then the row attends as above. One
// call per layer where XLA ran seven small ops besides the attention (the slot's index, two
// scatters and their transposes, the clamped table, the query's scaling), each a few
// microseconds at decode. Rules as `jaxtier.kvcache.paged.write_chunk`: a negative position, a
// -1 table entry, a position beyond the table or a page beyond the pool writes nothing. The
// attention's table is the offset one clamped to the pool, as `paged.attend` passes it. The pool
// results alias the pool operands (updated in place); q arrives unscaled and is scaled here as
// `paged_attention_cpu` scales it (one float32 product).
template <typename T>
ffi::Error WriteAndAttend(ffi::ThreadPool pool, const ffi::AnyBuffer& q_in, float scale,
                          const ffi::AnyBuffer& k_new, const ffi::AnyBuffer& v_new,
                          const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages,
                          const int32_t* tables, const int32_t* pos, int32_t offset, Shape s,
                          float* out, T* k_out, T* v_out) {
  const int64_t b = s.batch, kvh = s.kv_heads, f = s.pages, c = s.block_size, d = s.head_dim,
                m = s.table_width;
  const int64_t pool_elements = kvh * f * c * d;
  // XLA passes the aliased result as the operand's own buffer; were it ever a separate one, the
  // pool is copied in first so the result is still the whole updated pool.
  if (k_out != k_pages.untyped_data())
    std::memcpy(k_out, k_pages.untyped_data(), sizeof(T) * pool_elements);
  if (v_out != v_pages.untyped_data())
    std::memcpy(v_out, v_pages.untyped_data(), sizeof(T) * pool_elements);
  const T* kn = static_cast<const T*>(k_new.untyped_data());
  const T* vn = static_cast<const T*>(v_new.untyped_data());
  for (int64_t r = 0; r < b; ++r) {
    const int64_t p = pos[r];
    if (p < 0 || p >= m * c) continue;
    const int64_t entry = tables[r * m + p / c];
    if (entry < 0) continue;
    const int64_t page = entry + offset;
    if (page < 0 || page >= f) continue;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t slot = ((h * f + page) * c + p % c) * d;
      std::memcpy(k_out + slot, kn + (r * kvh + h) * d, sizeof(T) * d);
      std::memcpy(v_out + slot, vn + (r * kvh + h) * d, sizeof(T) * d);
    }
  }
  std::vector<int32_t> clamped(b * m);
  for (int64_t i = 0; i < b * m; ++i) {
    const int64_t page = tables[i] >= 0 ? static_cast<int64_t>(tables[i]) + offset : -1;
    clamped[i] = static_cast<int32_t>(std::clamp<int64_t>(page, 0, f - 1));
  }
  std::vector<float> q(b * s.heads * d);
  const float* q_raw = static_cast<const float*>(q_in.untyped_data());
  for (size_t i = 0; i < q.size(); ++i) q[i] = q_raw[i] * scale;
  auto call = std::make_shared<Call>();
  static_cast<PoolArgs&>(*call) = {q.data(), k_out, v_out, clamped.data(), pos, nullptr, nullptr,
                                   out};
  call->s = s;
  return Run<T>(pool, call);  // returns once every item is done: the buffers above outlive it
}

ffi::Error PagedDecodeWriteAttentionImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> tables,
    ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float scale) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), pd = k_pages.dimensions(),
             td = tables.dimensions();
  // The pool as [k, l, p, c, d] (the device pool's own shape: a reshape in XLA before the call
  // made XLA copy the whole pool around it); its pages are addressed as [k, l * p, c, d].
  if (pd.size() != 5) {
    return ffi::Error::InvalidArgument("pages [k, l, p, c, d] expected");
  }
  const int64_t kd[4] = {pd[0], pd[1] * pd[2], pd[3], pd[4]};
  const ffi::DataType type = k_pages.element_type();
  if (qd.size() != 3 || nd.size() != 3 || td.size() != 2 ||
      q.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32 ||
      !SameDims(out->dimensions(), qd)) {
    return ffi::Error::InvalidArgument(
        "q and out [b, n, d] float32, new k and v [b, k, d], pages [k, l, p, c, d], tables "
        "[b, m] expected");
  }
  if (type != ffi::DataType::F32 && type != ffi::DataType::U16) {
    return ffi::Error::InvalidArgument("pages must be float32 or uint16 (bfloat16 bits)");
  }
  for (const ffi::AnyBuffer* x : {&k_new, &v_new, &v_pages}) {
    if (x->element_type() != type) return ffi::Error::InvalidArgument("one storage type expected");
  }
  if (!SameDims(v_new.dimensions(), nd) || !SameDims(v_pages.dimensions(), pd) ||
      !SameDims(k_out->dimensions(), pd) || !SameDims(v_out->dimensions(), pd) ||
      k_out->element_type() != type || v_out->element_type() != type || kd[0] == 0 ||
      kd[1] == 0 ||
      qd[1] % kd[0] || nd[0] != qd[0] || nd[1] != kd[0] || nd[2] != qd[2] || kd[3] != qd[2] ||
      td[0] != qd[0] || static_cast<int64_t>(pos.element_count()) != qd[0] ||
      offset.element_count() != 1) {
    return ffi::Error::InvalidArgument("paged attention arguments do not fit together");
  }
  Shape s{qd[0], qd[1], kd[0], qd[1] / kd[0], qd[2], kd[1], kd[2], td[1]};
  float* o = static_cast<float*>(out->untyped_data());
  const int32_t shift = offset.typed_data()[0];
  if (type == ffi::DataType::F32) {
    return WriteAndAttend<float>(pool, q, scale, k_new, v_new, k_pages, v_pages,
                                 tables.typed_data(), pos.typed_data(), shift, s, o,
                                 static_cast<float*>(k_out->untyped_data()),
                                 static_cast<float*>(v_out->untyped_data()));
  }
  return WriteAndAttend<uint16_t>(pool, q, scale, k_new, v_new, k_pages, v_pages,
                                  tables.typed_data(), pos.typed_data(), shift, s, o,
                                  static_cast<uint16_t*>(k_out->untyped_data()),
                                  static_cast<uint16_t*>(v_out->untyped_data()));
}

// ---------------------------------------------------------------------------------------------
// Prefill rows: t query tokens per row (the pieces of prompts a prefill step computes), each
// attending to the slots 0..its position of the row's table. An item is (row, kv head): its t x g
// query vectors against the row's visible slots, in four steps:
//   1. the visible keys, transposed into blocks of kNL slots ([blocks][d][kNL] floats), and the
//      visible values as float rows ([slots][d]), int8 scales applied, in per-thread buffers;
//   2. for each tile of kScoreRows query vectors, their scores over the slots the tile sees, kept
//      as kScoreRows x kScoreBlocks vectors of sums in registers while the tile walks d (each
//      key vector loaded once for the tile's queries, no lane sums);
//   3. each query's softmax over its own visible slots, zeros past them;
//   4. probabilities @ values in register tiles of up to kPvVectors sums (queries x vectors of
//      d, in column chunks of at most kPvChunk vectors).
// The XLA path's scan gathered every chunk's pages into copies and computed the rows of a group
// up to the group's longest; this kernel reads the pages in place and stops at each row's own
// length. Items are claimed longest row first (dynamic claiming balances
// the rest).

constexpr int kScoreRows = kNL == 16 ? 12 : 4;  // query vectors per score tile
constexpr int kScoreBlocks = 2;                 // blocks of kNL slots per score tile
constexpr int kPvVectors = kNL == 16 ? 24 : 8;  // output vectors a PV tile keeps in registers
constexpr int kPvChunk = kNL == 16 ? 8 : 4;     // most vectors of d one PV pass covers

// Scores [kScoreRows, kScoreBlocks * kNL] of query tile qt [kScoreRows][d] against key blocks
// kt [blocks][d][kNL] from block `blk`, stored at sc[r * stride + slot].
inline void ScoreTile(const float* qt, const float* kt, int64_t d, int64_t blk, float* sc,
                      int64_t stride) {
  static_assert(kScoreBlocks == 2, "ScoreTile loads two key vectors per step");
  VN acc[kScoreRows][kScoreBlocks] = {};
  const float* k0 = kt + blk * d * kNL;
  const float* k1 = k0 + d * kNL;
  for (int64_t i = 0; i < d; ++i) {
    VN a = LoadN(k0 + i * kNL), b = LoadN(k1 + i * kNL);
#if defined(__AVX__)
    asm("" : "+v"(a), "+v"(b));  // keep them in registers (see LoadPanelRow in matmul_cpu.cc)
#endif
    for (int r = 0; r < kScoreRows; ++r) {
      const VN qv = qt[r * d + i] - VN{};  // one broadcast load
      acc[r][0] += qv * a;
      acc[r][1] += qv * b;
    }
  }
  for (int r = 0; r < kScoreRows; ++r)
    for (int j = 0; j < kScoreBlocks; ++j) StoreN(sc + r * stride + (blk + j) * kNL, acc[r][j]);
}

// out[r][0, DV kNL) = sum_s p[r * stride + s] * vc[s * d, + DV kNL) for R query rows and slots
// [0, slots): R x DV sums in registers.
template <int R, int DV>
inline void PvTile(const float* p, int64_t stride, const float* vc, int64_t d, int64_t slots,
                   float* out, int64_t out_stride) {
  VN acc[R][DV] = {};
  for (int64_t s = 0; s < slots; ++s) {
    VN vv[DV];
    for (int j = 0; j < DV; ++j) {
      VN x = LoadN(vc + s * d + j * kNL);
#if defined(__AVX__)
      asm("" : "+v"(x));
#endif
      vv[j] = x;
    }
    for (int r = 0; r < R; ++r) {
      const VN pr = p[r * stride + s] - VN{};
      for (int j = 0; j < DV; ++j) acc[r][j] += pr * vv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) StoreN(out + r * out_stride + j * kNL, acc[r][j]);
}

// The same for one query row of any head dim, sums in memory.
inline void PvRowGeneric(const float* p, const float* vc, int64_t slots, int64_t d, float* out) {
  std::fill(out, out + d, 0.0f);
  for (int64_t s = 0; s < slots; ++s) {
    const float w = p[s];
    const float* v = vc + s * d;
    for (int64_t i = 0; i < d; ++i) out[i] += w * v[i];
  }
}

// Rows [0, rows) of probabilities @ values for d = DV vectors of kNL, in column chunks of C
// vectors and PvTiles of R rows (a row at a time for the rest); the sums land in `out` rows
// out_stride apart. With AVX2's 16 registers, chunks of 4 vectors keep 2 rows' sums held where a
// whole d-64 row (8 vectors) would leave room for one.
template <int DV>
void PvRows(const float* p, int64_t stride, const float* vc, int64_t slots, int64_t rows,
            float* out, int64_t out_stride) {
  constexpr int C = DV < kPvChunk ? DV : kPvChunk;
  constexpr int R = kPvVectors / C > 0 ? kPvVectors / C : 1;
  constexpr int64_t d = DV * kNL;
  for (int64_t c = 0; c < d; c += C * kNL) {
    int64_t r = 0;
    for (; r + R <= rows; r += R)
      PvTile<R, C>(p + r * stride, stride, vc + c, d, slots, out + r * out_stride + c, out_stride);
    for (; r < rows; ++r)
      PvTile<1, C>(p + r * stride, stride, vc + c, d, slots, out + r * out_stride + c, out_stride);
  }
}

struct PrefillShape {
  int64_t batch, tokens, heads, kv_heads, group, head_dim, pages, block_size, table_width;
};

struct PrefillBuffers {
  std::vector<float> kt, vc, qt, sc, sums;
};

// One item: row b, kv head kvh (see the section comment).
template <typename T>
void PrefillItem(const PrefillShape& s, int64_t b, int64_t kvh, const float* q, const T* k,
                 const T* v, const int32_t* tables, const int32_t* pos, const float* k_scales,
                 const float* v_scales, float* out, PrefillBuffers& buf) {
  const int64_t t = s.tokens, g = s.group, d = s.head_dim, c = s.block_size;
  const int64_t capacity = s.table_width * c;
  const int32_t* pos_b = pos + b * t;
  // Output rows of query vector qi = token * g + head (token major, as q is laid out).
  auto offset = [&](int64_t qi) { return ((b * t + qi / g) * s.heads + kvh * g + qi % g) * d; };
  auto q_row = [&](int64_t qi) { return q + offset(qi); };
  auto out_row = [&](int64_t qi) { return out + offset(qi); };
  auto visible = [&](int64_t qi) {  // slots query vector qi sees
    return std::clamp<int64_t>(static_cast<int64_t>(pos_b[qi / g]) + 1, 0, capacity);
  };
  const int64_t queries = t * g;
  int64_t slots = 0;
  for (int64_t i = 0; i < t; ++i) slots = std::max(slots, visible(i * g));
  if (slots == 0) {
    for (int64_t qi = 0; qi < queries; ++qi) std::fill_n(out_row(qi), d, 0.0f);
    return;
  }
  // 1. Keys transposed into blocks (padded with zeros to whole score tiles), values as rows.
  const int64_t span = kScoreBlocks * kNL;
  const int64_t padded = (slots + span - 1) / span * span;
  buf.kt.assign(padded * d, 0.0f);
  buf.vc.resize(slots * d);
  const int32_t* table = tables + b * s.table_width;
  const int64_t head_base = kvh * s.pages;
  for (int64_t start = 0; start < slots; start += c) {
    const int64_t page = head_base + table[start / c];
    const int64_t n = std::min(c, slots - start);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = start + j;
      const T* key = k + (page * c + j) * d;
      const T* value = v + (page * c + j) * d;
      const float ks = k_scales ? k_scales[page * c + j] : 1.0f;
      const float vs = v_scales ? v_scales[page * c + j] : 1.0f;
      float* kt = buf.kt.data() + (slot / kNL) * d * kNL + slot % kNL;
      float* vc = buf.vc.data() + slot * d;
      for (int64_t i = 0; i < d; ++i) {
        kt[i * kNL] = Load(key[i]) * ks;
        vc[i] = Load(value[i]) * vs;
      }
    }
  }
  buf.qt.resize(kScoreRows * d);
  buf.sc.resize(kScoreRows * padded);
  buf.sums.resize(kScoreRows * d);
  float* sc = buf.sc.data();
  for (int64_t first = 0; first < queries; first += kScoreRows) {
    const int64_t rows = std::min<int64_t>(kScoreRows, queries - first);
    int64_t seen = 0;  // slots this tile sees
    for (int64_t r = 0; r < rows; ++r) seen = std::max(seen, visible(first + r));
    if (seen == 0) {
      for (int64_t r = 0; r < rows; ++r) std::fill_n(out_row(first + r), d, 0.0f);
      continue;
    }
    // 2. Scores of the tile (missing rows are zero queries, their scores unused).
    for (int64_t r = 0; r < kScoreRows; ++r) {
      float* dst = buf.qt.data() + r * d;
      if (r < rows) std::memcpy(dst, q_row(first + r), sizeof(float) * d);
      else std::fill(dst, dst + d, 0.0f);
    }
    for (int64_t blk = 0; blk * kNL < seen; blk += kScoreBlocks)
      ScoreTile(buf.qt.data(), buf.kt.data(), d, blk, sc, padded);
    // 3. Softmax over each query's visible slots; zeros up to the tile's end.
    float total[kScoreRows];
    for (int64_t r = 0; r < rows; ++r) {
      float* row = sc + r * padded;
      const int64_t n = visible(first + r);
      total[r] = n ? SoftmaxInPlace(row, n) : 1.0f;
      std::fill(row + n, row + seen, 0.0f);
    }
    // 4. Probabilities @ values, normalized.
    float* sums = buf.sums.data();
    switch (d / kNL * (d % kNL == 0)) {
      case 1: PvRows<1>(sc, padded, buf.vc.data(), seen, rows, sums, d); break;
      case 2: PvRows<2>(sc, padded, buf.vc.data(), seen, rows, sums, d); break;
      case 4: PvRows<4>(sc, padded, buf.vc.data(), seen, rows, sums, d); break;
      case 8: PvRows<8>(sc, padded, buf.vc.data(), seen, rows, sums, d); break;
      case 16: PvRows<16>(sc, padded, buf.vc.data(), seen, rows, sums, d); break;
      default:
        for (int64_t r = 0; r < rows; ++r)
          PvRowGeneric(sc + r * padded, buf.vc.data(), seen, d, sums + r * d);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = out_row(first + r);
      if (visible(first + r) == 0) {
        std::fill(dst, dst + d, 0.0f);
        continue;
      }
      const float inv = 1.0f / total[r];
      for (int64_t i = 0; i < d; ++i) dst[i] = sums[r * d + i] * inv;
    }
  }
}

struct PrefillCall : jaxtier::Job, PoolArgs {
  PrefillShape s;
  std::vector<int64_t> order;  // rows, longest first
  void (*item_fn)(const PrefillCall&, int64_t) = nullptr;
  void RunItem(int64_t item) override { item_fn(*this, item); }
};

template <typename T>
void PrefillOne(const PrefillCall& call, int64_t item) {
  thread_local PrefillBuffers buf;
  PrefillItem<T>(call.s, call.order[item / call.s.kv_heads], item % call.s.kv_heads, call.q,
                 static_cast<const T*>(call.k), static_cast<const T*>(call.v), call.tables,
                 call.pos, call.k_scales, call.v_scales, call.out, buf);
}

template <typename T>
ffi::Error RunPrefill(ffi::ThreadPool pool, std::shared_ptr<PrefillCall> call) {
  const PrefillShape& s = call->s;
  std::vector<std::pair<int64_t, int64_t>> rows(s.batch);  // (-longest position, row)
  int64_t work = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    int64_t longest = -1;
    for (int64_t i = 0; i < s.tokens; ++i)
      longest = std::max<int64_t>(longest, call->pos[b * s.tokens + i]);
    rows[b] = {-longest, b};
    work += std::max<int64_t>(longest + 1, 0) * s.tokens;
  }
  std::sort(rows.begin(), rows.end());
  call->order.resize(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) call->order[b] = rows[b].second;
  call->items = s.batch * s.kv_heads;
  call->item_fn = PrefillOne<T>;
  const int64_t helpers =
      work * s.kv_heads < 4096 ? 0 : std::min<int64_t>(pool.num_threads(), call->items - 1);
  jaxtier::RunJob(call, helpers);
  return ffi::Error::Success();
}

ffi::Error PagedPrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                     ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                     ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> pos,
                                     ffi::Buffer<ffi::F32> k_scales,
                                     ffi::Buffer<ffi::F32> v_scales,
                                     ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = tables.dimensions();
  auto pd = pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || pd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "q [b, t, n, d], pages [k, f, c, d], tables [b, m], positions [b, t] expected");
  }
  PrefillShape s{qd[0], qd[1], qd[2], kd[0], 0, qd[3], kd[1], kd[2], td[1]};
  auto call = std::make_shared<PrefillCall>();
  if (ffi::Error error = UnpackPool(q, k_pages, v_pages, tables, pos, k_scales, v_scales, out,
                                    *call);
      error.failure()) {
    return error;
  }
  if (s.heads % s.kv_heads || kd[3] != s.head_dim || td[0] != s.batch || pd[0] != s.batch ||
      pd[1] != s.tokens) {
    return ffi::Error::InvalidArgument("paged prefill attention arguments do not fit together");
  }
  s.group = s.heads / s.kv_heads;
  call->s = s;
  return ByPageType(k_pages.element_type(),
                    [&](auto page) { return RunPrefill<decltype(page)>(pool, call); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierPagedPrefillAttention, PagedPrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierPagedDecodeWriteAttention, PagedDecodeWriteAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
