// x @ w for XLA:CPU with w packed in column panels, called through the XLA FFI (see
// jaxtier/matmul.py for the layout and jaxtier/cpu_kernels.py for the build).
//
// The packed weight is [N / P, K, P]: panel p holds columns [P p, P p + P) of the [K, N] matrix,
// row by row, so a panel is one contiguous stream. P is the width of the register tile, which
// depends on the vector registers the build has (`JaxtierPanelWidth`): 64 columns (4 vectors of
// 16) with AVX-512's 32 registers, 16 columns (2 vectors of 8) with AVX2's 16. An item is
// (panel, block of up to 96 rows of x); for every tile of up to 6 rows it keeps 6 x P sums in
// registers (24 of 32 registers with AVX-512, 12 of 16 with AVX2) while it walks the panel's K
// rows once. At decode (a few rows) each weight is read once from memory in order, which
// XLA:CPU's skinny matmuls do not manage; at prefill the panel stays in the core's cache across
// the row tiles. Items are pulled from an atomic counter by the calling thread and by the
// kernels' crew of helper threads (jaxtier/cpu_crew.h).
//
// Why the width follows the registers: with AVX2's 16 registers a 64-column tile spills its 48
// accumulators, and 16-column tiles walking a 64-column panel (a 256-byte stride) run well below
// their rate over 16-column panels.
//
// Weights come in these formats (the `format` attribute), all in panels: float32; GGUF's Q4_1
// blocks (kQ4_1: for every 32 K rows of a panel, the blocks' scales d and minimums m, float32,
// kPanel each, then their 4-bit values q row by row, a row's byte j holding column j in its low
// nibble and column j + kPanel / 2 in its high one; w = d q + m); GGUF's Q8_0 blocks (kQ8_0:
// for every 32 K rows, the scales d, float32, then the 8-bit values row by row; w = d q); or
// 8-bit values with d and m per 16 K rows (kQ8_16), which hold the other GGUF types. Each pass
// of an item dequantizes its 64 panel rows into a buffer in the core's cache, where the tiles
// read them as they read float32 panels. d q is exact in float32 (an 11-bit d times a 4- or
// 8-bit q), so d q + m rounds once, as GGUF's float32 dequantization does, and the product is bit
// for bit the float32 kernel's on the dequantized weights, from 0.75 (Q4_1), 1.125 (Q8_0) or 1.5
// (Q8_16) bytes per weight instead of 4. The int16-activation formats are further below.
//
// x is float32 [M, K] (row-major), out float32 [M, N]. Other handlers apply an RMS norm to x's
// rows first (the pre-norm of a decoder layer's q/k/v and gate/up projections), with the bias and
// rotary embedding of the q/k/v projection after, or the SwiGLU gating (the input of a decoder
// layer's down projection).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_crew.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxtier::I16;
using jaxtier::IN;
using jaxtier::LoadN;
using jaxtier::LoadV;
using jaxtier::StoreN;
using jaxtier::V16;
using jaxtier::VN;

constexpr int kLanes = jaxtier::kNativeLanes;
constexpr bool kWide = kLanes == 16;            // AVX-512
constexpr int kVecs = kWide ? 4 : 2;           // vectors per tile row
constexpr int64_t kPanel = kVecs * kLanes;     // columns per panel
constexpr int64_t kRowBlock = 96;              // rows of x per work item
constexpr int kTile = 6;                       // rows per register tile: 6 x kVecs accumulators
static_assert(kTile == 6, "TileOf dispatches heights 1 to 6");

// Panel rows per pass of the tiles over an item's rows, the rows from which an item prefetches,
// and the cache level its prefetches fill. Each tile walking the whole panel (the first from
// memory, the others from cache) made the memory stream and the arithmetic take turns, so a
// step's matmuls cost about their sum. In passes, the next pass's panel rows are prefetched while
// this pass computes, the prefetches shared out evenly over the pass's tiles (the first tile
// issuing them all was slower). The sums of a pass live in a buffer of the item's rows (the
// output rows are n floats apart; their 4 KB aliasing made reloading them there slower than one
// pass).
// AVX2, tuned on a Zen 3 CPU with two threads: passes of 64 panel rows (4 KB) prefetched into L1
// from 3 rows on; one or two rows stream at the memory's rate without help.
// AVX-512, tuned on an Intel Xeon with AMX (Sapphire Rapids class) with two threads: passes of 64
// panel rows (16 KB), from one row on, prefetched into L2 (prefetcht1; into L1, the next 16 KB
// crowds the 48 KB L1 that holds this pass, x and the sums).
constexpr int64_t kPassRows = 64;
constexpr int64_t kPrefetchFromRows = kWide ? 1 : 3;
constexpr int kPrefetchLocality = kWide ? 2 : 3;  // __builtin_prefetch: 2 = L2 and out, 3 = L1
constexpr int64_t kLine = 64;                  // bytes per cache line

// Weight formats (the handlers' `format` attribute; jaxtier.kernels.cpu.matmul's FORMATS).
constexpr int64_t kF32 = 0;
constexpr int64_t kQ4_1 = 1;
constexpr int64_t kQ8_0 = 2;
constexpr int64_t kQBlock = 32;                            // K rows per Q4_1 or Q8_0 block
constexpr int64_t kQ4Bytes = 2 * 4 * kPanel + kQBlock * kPanel / 2;  // one Q4_1 block of a panel
constexpr int64_t kQ8Bytes = 4 * kPanel + kQBlock * kPanel;         // one Q8_0 block of a panel
// The same blocks laid out for int16 activations, in panels of kLanes columns (further below).
constexpr int64_t kQ4_1I16 = 3;
constexpr int64_t kQ8_0I16 = 4;
constexpr int64_t kQ4I16Bytes = 24 * kLanes;  // one Q4_1 block of a kLanes-column panel
constexpr int64_t kQ8I16Bytes = 36 * kLanes;
// 8-bit values with a scale d and minimum m per 16 K rows (kQ8_16: for every 32 K rows of a
// panel, the first half's d and m, the second half's d and m, float32, kPanel each, then the
// values row by row; w = d q + m): every GGUF type whose values fit 8 bits (the k-quants' scales
// per 16 or 32 values, Q5_1, Q5_0, Q8_0), so a fused kernel of parts in different types stays in
// blocks.
constexpr int64_t kQ8_16 = 5;
constexpr int64_t kQ816Bytes = 16 * kPanel + kQBlock * kPanel;
constexpr int64_t kQ8_16I16 = 6;  // the same with int16 activations, in kLanes-column panels
constexpr int64_t kQ816I16Bytes = 48 * kLanes;
static_assert(kPassRows % kQBlock == 0, "a pass dequantizes whole blocks");

// Bytes of a panel's rows [0, i) (i a multiple of kQBlock for the block formats).
inline int64_t RowBytes(int64_t format, int64_t i) {
  constexpr int64_t kBlockBytes[] = {0,           kQ4Bytes,   kQ8Bytes,     kQ4I16Bytes,
                                     kQ8I16Bytes, kQ816Bytes, kQ816I16Bytes};
  if (format == kF32) return i * kPanel * 4;
  return i / kQBlock * kBlockBytes[format];
}

// kLanes bytes (signed or not) widened to int32 lanes (GCC's __builtin_convertvector of a byte
// vector compiles to a byte at a time).
template <bool kSigned>
inline IN WidenBytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const auto* in = reinterpret_cast<const __m128i*>(p);
  return reinterpret_cast<IN>(kSigned ? _mm512_cvtepi8_epi32(_mm_loadu_si128(in))
                                      : _mm512_cvtepu8_epi32(_mm_loadu_si128(in)));
#elif defined(__AVX2__)
  const auto* in = reinterpret_cast<const __m128i*>(p);
  return reinterpret_cast<IN>(kSigned ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(in))
                                      : _mm256_cvtepu8_epi32(_mm_loadl_epi64(in)));
#else
  IN v;
  for (int l = 0; l < kLanes; ++l)
    v[l] = kSigned ? static_cast<int8_t>(p[l]) : static_cast<int32_t>(p[l]);
  return v;
#endif
}

// A block of a panel in format kFormat (kQ4_1, kQ8_0 or kQ8_16): its bytes, where its values
// start, the bytes of one of its rows, and its scales d (and minimums m) as vectors: kQ8_16's
// first half's, until `Load(block, 1)` loads the second's (at row kHalfRows).
constexpr int64_t kHalfRows = kQBlock / 2;
template <int64_t kFormat>
struct Block {
  static constexpr bool kHalves = kFormat == kQ8_16;
  static constexpr int64_t kBytes =
      kFormat == kQ4_1 ? kQ4Bytes : kFormat == kQ8_0 ? kQ8Bytes : kQ816Bytes;
  static constexpr int64_t kValues = (kFormat == kQ4_1 ? 8 : kFormat == kQ8_0 ? 4 : 16) * kPanel;
  static constexpr int64_t kRowBytes = kFormat == kQ4_1 ? kPanel / 2 : kPanel;
  VN d[kVecs], m[kVecs];
  explicit Block(const uint8_t* block) { Load(block, 0); }
  void Load(const uint8_t* block, int half) {
    const float* scales = reinterpret_cast<const float*>(block) + half * 2 * kPanel;
    for (int j = 0; j < kVecs; ++j) {
      d[j] = LoadN(scales + j * kLanes);
      if constexpr (kFormat != kQ8_0) m[j] = LoadN(scales + kPanel + j * kLanes);
    }
  }
  // The kVecs weight vectors of the panel row whose values start at q: d q + m (Q4_1: byte j
  // holds columns j and j + kPanel / 2; Q8_16: signed bytes), or d q (Q8_0). d q is exact in
  // float32 for every GGUF type held (an 11-bit d times a 4- or 8-bit q; a k-quant's d, an
  // 11-bit float16 times a scale of at most 7 significant bits, times a q of at most 5: 23
  // bits), so d q + m rounds once, as GGUF's float32 dequantization does.
  void Row(const uint8_t* q, VN (&w)[kVecs]) const {
    if constexpr (kFormat == kQ8_16) {
      for (int j = 0; j < kVecs; ++j)
        w[j] = d[j] * __builtin_convertvector(WidenBytes<true>(q + j * kLanes), VN) + m[j];
    } else if constexpr (kFormat == kQ4_1) {
      constexpr int kHalf = kVecs / 2;
      for (int j = 0; j < kHalf; ++j) {
        const IN v = WidenBytes<false>(q + j * kLanes);
        w[j] = d[j] * __builtin_convertvector(v & 15, VN) + m[j];
        w[j + kHalf] = d[j + kHalf] * __builtin_convertvector(v >> 4, VN) + m[j + kHalf];
      }
    } else {
      for (int j = 0; j < kVecs; ++j)
        w[j] = d[j] * __builtin_convertvector(WidenBytes<true>(q + j * kLanes), VN);
    }
  }
};

// Dequantizes one block of a panel into its kQBlock x kPanel floats.
template <int64_t kFormat>
inline void Dequantize(const uint8_t* block, float* out) {
  using B = Block<kFormat>;
  B scales(block);
  const uint8_t* q = block + B::kValues;
  for (int64_t r = 0; r < kQBlock; ++r, q += B::kRowBytes, out += kPanel) {
    if constexpr (B::kHalves)
      if (r == kHalfRows) scales.Load(block, 1);
    VN w[kVecs];
    scales.Row(q, w);
    for (int j = 0; j < kVecs; ++j) StoreN(out + j * kLanes, w[j]);
  }
}

// Loads a panel row's kVecs weight vectors into v, pinned in registers by an empty asm: without
// it the compiler folds the weight loads into every row's multiply-add, loading each weight
// vector once per row (with AVX2 that slowed tiles of 2-4 rows most). The asm takes named values,
// not the array: given the array, GCC kept it in memory too and stored every weight vector to the
// stack on every panel row (4 dead 64-byte stores per row with AVX-512).
inline void LoadPanelRow(const float* w, VN (&v)[kVecs]) {
  VN a = LoadN(w), b = LoadN(w + kLanes);
  if constexpr (kVecs == 4) {
    VN c = LoadN(w + 2 * kLanes), d = LoadN(w + 3 * kLanes);
#if defined(__AVX__)
    asm("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d));
#endif
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
  } else {
#if defined(__AVX__)
    asm("" : "+v"(a), "+v"(b));
#endif
    v[0] = a, v[1] = b;
  }
}

// sums[R rows, kPanel columns] (row stride s) += (or =, without `accumulate`) x[R rows, steps]
// (row stride k) @ w[steps panel rows], prefetching `prefetch_lines` lines from `prefetch` on,
// spread evenly over the steps.
template <int R>
inline void Tile(const float* x, int64_t k, const float* w, int64_t steps, float* sums,
                 int64_t s, bool accumulate, const char* prefetch, int64_t prefetch_lines) {
  VN acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j)
      acc[r][j] = accumulate ? LoadN(sums + r * s + kLanes * j) : VN{};
  int64_t credit = 0;
  for (int64_t i = 0; i < steps; ++i, w += kPanel) {
    for (credit += prefetch_lines; credit >= steps; credit -= steps, prefetch += kLine)
      __builtin_prefetch(prefetch, 0, kPrefetchLocality);
    VN wv[kVecs];
    LoadPanelRow(w, wv);
    for (int r = 0; r < R; ++r) {
      // x - 0 is x for every x, so this is one broadcast load (0 + x is not: -0 + 0 is +0).
      const VN xv = x[r * k + i] - VN{};
      for (int j = 0; j < kVecs; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) StoreN(sums + r * s + kLanes * j, acc[r][j]);
}

// Tile<height> for a height of 1 to kTile rows.
inline void TileOf(int64_t height, const float* x, int64_t k, const float* w, int64_t steps,
                   float* sums, int64_t s, bool accumulate, const char* prefetch,
                   int64_t prefetch_lines) {
  switch (height) {
    case 6: return Tile<6>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    case 5: return Tile<5>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    case 4: return Tile<4>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    case 3: return Tile<3>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    case 2: return Tile<2>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    case 1: return Tile<1>(x, k, w, steps, sums, s, accumulate, prefetch, prefetch_lines);
    default: return;
  }
}

// Tile for items of up to kDirectRows rows of a block format: each panel row dequantized in
// registers and multiplied at once, where storing a dequantized pass and loading it back cost
// more than its few multiply-adds. The same d q (+ m) and the same multiply-adds in the same
// order as Tile on a dequantized pass, so the same sums.
constexpr int64_t kDirectRows = 4;
template <int64_t kFormat, int R>
inline void TileBlocks(const float* x, int64_t k, const uint8_t* blocks, int64_t steps,
                       float* sums, int64_t s, bool accumulate, const char* prefetch,
                       int64_t prefetch_lines) {
  using B = Block<kFormat>;
  VN acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j)
      acc[r][j] = accumulate ? LoadN(sums + r * s + kLanes * j) : VN{};
  int64_t credit = 0;
  for (int64_t i = 0; i < steps; blocks += B::kBytes) {
    B scales(blocks);
    const uint8_t* q = blocks + B::kValues;
    for (int64_t row = 0; row < kQBlock; ++row, ++i, q += B::kRowBytes) {
      if constexpr (B::kHalves)
        if (row == kHalfRows) scales.Load(blocks, 1);
      for (credit += prefetch_lines; credit >= steps; credit -= steps, prefetch += kLine)
        __builtin_prefetch(prefetch, 0, kPrefetchLocality);
      VN w[kVecs];
      scales.Row(q, w);
      for (int r = 0; r < R; ++r) {
        const VN xv = x[r * k + i] - VN{};
        for (int j = 0; j < kVecs; ++j) acc[r][j] += xv * w[j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) StoreN(sums + r * s + kLanes * j, acc[r][j]);
}

// TileBlocks<format, rows> for 1 to kDirectRows rows.
template <int64_t kFormat>
inline void TileBlocksOf(int64_t rows, const float* x, int64_t k, const uint8_t* blocks,
                         int64_t steps, float* sums, int64_t s, bool accumulate,
                         const char* prefetch, int64_t prefetch_lines) {
  static_assert(kDirectRows == 4, "TileBlocksOf dispatches 1 to 4 rows");
  switch (rows) {
    case 1: return TileBlocks<kFormat, 1>(x, k, blocks, steps, sums, s, accumulate, prefetch,
                                          prefetch_lines);
    case 2: return TileBlocks<kFormat, 2>(x, k, blocks, steps, sums, s, accumulate, prefetch,
                                          prefetch_lines);
    case 3: return TileBlocks<kFormat, 3>(x, k, blocks, steps, sums, s, accumulate, prefetch,
                                          prefetch_lines);
    default: return TileBlocks<kFormat, 4>(x, k, blocks, steps, sums, s, accumulate, prefetch,
                                           prefetch_lines);
  }
}

// Block formats with int16 activations (kQ4_1I16, kQ8_0I16, kQ8_16I16): the same blocks in
// panels of kLanes columns, laid out for integer dot products, multiplied by x quantized per block
// of 32 values to int16 (one float32 scale per block). Per block, each column's 32 products sum
// exactly in int32; the block then adds (d_w d_x) sum (+ m_w s_x, s_x = d_x sum q_x, for Q4_1)
// to the column's float32 sum (Q8_16: per half of 16 rows, with the half's d_w, m_w and s_x).
// Each lane of a vector holds one column; a 32-bit lane multiplies a pair of K rows at once
// (vpdpwssd with AVX512-VNNI, vpmaddwd + add without). A panel's block is d (and m) as float32,
// kLanes each, then its values in pairs of K rows: Q4_1, for pair t in [0, 8) and column c, 2
// bytes holding rows 2t and 2t + 1 in their low nibbles and rows 16 + 2t and 17 + 2t in their
// high ones; Q8_0, for pair t in [0, 16), 2 bytes holding rows 2t and 2t + 1 (Q8_16 the same,
// after the two halves' d and m). Against float32 activations a block costs a 16-32x cheaper
// multiply per pair of rows and no float dequantization; x's rounding to 16 bits (a relative
// 1.5e-5 of its block's largest value) moves the logits a little, so the products are no longer
// bit for bit the dequantized weights'.
constexpr int kTileI16 = kWide ? 8 : 4;      // rows per tile: 2 x 8 accumulators of 32
constexpr int64_t kI16Group = kPanel / kLanes;  // panels per work item (kPanel columns)
// A tile that streams its panel from memory (the first of an item's rows) prefetches the lines
// kI16Ahead bytes ahead into L2: without it the tile waits on the stream; 4 KB was the best of
// the distances tried (2, 4 and 8 KB), and L2 better than L1.
constexpr int64_t kI16Ahead = 4096;
constexpr float kI16Max = 32767.0f;

inline bool IsI16(int64_t format) {
  return format == kQ4_1I16 || format == kQ8_0I16 || format == kQ8_16I16;
}

// The lanes of v rounded to the nearest integer, ties to even (the default rounding mode). Not
// (v + 1.5 2^23) - 1.5 2^23: the compiler fuses the product that makes v into that add, which
// rounds the exact product instead of v.
inline I16 RoundLanes(V16 v) {
#if defined(__AVX512F__)
  return reinterpret_cast<I16>(_mm512_cvtps_epi32(reinterpret_cast<__m512>(v)));
#else
  I16 out;
  for (int l = 0; l < 16; ++l) out[l] = static_cast<int32_t>(std::nearbyint(v[l]));
  return out;
#endif
}

// The sum of v's 16 lanes.
inline int32_t SumInts(I16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_epi32(reinterpret_cast<__m512i>(v));
#else
  int32_t sum = 0;
  for (int l = 0; l < 16; ++l) sum += v[l];
  return sum;
#endif
}

// x [m, k] -> q [m, k] int16, and per block of 32 values its scale d = max |x| / 32767 and
// s = d * (sum of its q), and where h is not null per half block h = d * (sum of the half's q);
// q = x / d rounded to nearest even (x * (1 / d), as llama.cpp's activation quantization computes
// it), 0 where the block is all zero.
void QuantizeRows(const float* x, int64_t m, int64_t k, int16_t* q, float* d, float* s,
                  float* h) {
  typedef int16_t I16x16 __attribute__((vector_size(32)));
  for (int64_t i = 0; i < m * k / kQBlock; ++i) {
    V16 a = LoadV(x + i * kQBlock), b = LoadV(x + i * kQBlock + 16);
    const V16 abs_a = a < 0 ? -a : a, abs_b = b < 0 ? -b : b;
    const V16 top = abs_a > abs_b ? abs_a : abs_b;
#if defined(__AVX512F__)
    const float amax = _mm512_reduce_max_ps(reinterpret_cast<__m512>(top));
#else
    float amax = 0;
    for (int l = 0; l < 16; ++l) amax = top[l] > amax ? top[l] : amax;
#endif
    // A NaN or infinity makes the block's scale NaN (and its q 0), so the products come out NaN
    // as the float path's would (a NaN is no lane's maximum, and an infinity's inverse is 0).
    const V16 finite = (a - a) + (b - b);  // 0 in every lane, unless NaN or +-inf
    bool ok = true;
    for (int l = 0; l < 16; ++l) ok &= finite[l] == 0.0f;
    if (!ok) a = b = V16{};
    const float scale = ok ? amax / kI16Max : std::numeric_limits<float>::quiet_NaN();
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    const I16 qa = RoundLanes(a * inv), qb = RoundLanes(b * inv);
    const int32_t sum = SumInts(qa + qb);
    const I16x16 na = __builtin_convertvector(qa, I16x16), nb = __builtin_convertvector(qb, I16x16);
    std::memcpy(q + i * kQBlock, &na, sizeof(na));
    std::memcpy(q + i * kQBlock + 16, &nb, sizeof(nb));
    d[i] = scale;
    s[i] = scale * static_cast<float>(sum);
    if (h != nullptr) {
      const int32_t low = SumInts(qa);
      h[2 * i] = scale * static_cast<float>(low);
      h[2 * i + 1] = scale * static_cast<float>(sum - low);
    }
  }
}

// 2 kLanes bytes widened to int16 (zero- or sign-extended), as kLanes int32 lanes of 2 words.
template <bool kSigned>
inline IN WidenPairs(const uint8_t* p) {
#if defined(__AVX512BW__)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<IN>(kSigned ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<IN>(kSigned ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v));
#else
  typedef int16_t W __attribute__((vector_size(4 * kLanes)));
  W w;
  for (int l = 0; l < 2 * kLanes; ++l)
    w[l] = kSigned ? static_cast<int8_t>(p[l]) : static_cast<int16_t>(p[l]);
  IN out;
  std::memcpy(&out, &w, sizeof(out));
  return out;
#endif
}

// acc + for each lane, w's two int16 times the pair of int16 x points to, summed.
inline IN DotPairs(IN acc, IN w, const int16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return reinterpret_cast<IN>(_mm512_dpwssd_epi32(reinterpret_cast<__m512i>(acc),
                                                  reinterpret_cast<__m512i>(w),
                                                  _mm512_set1_epi32(pair)));
#elif defined(__AVX512BW__)
  return acc + reinterpret_cast<IN>(_mm512_madd_epi16(reinterpret_cast<__m512i>(w),
                                                      _mm512_set1_epi32(pair)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  return acc + reinterpret_cast<IN>(_mm256_madd_epi16(reinterpret_cast<__m256i>(w),
                                                      _mm256_set1_epi32(pair)));
#else
  typedef int16_t W __attribute__((vector_size(4 * kLanes)));
  W words;
  std::memcpy(&words, &w, sizeof(words));
  for (int l = 0; l < kLanes; ++l) acc[l] += words[2 * l] * x[0] + words[2 * l + 1] * x[1];
  return acc;
#endif
}

// out[R rows, kLanes columns] (row stride n) = xq[R rows, K] (row stride k) @ a panel's `blocks`
// K / 32 blocks, with x's block scales dx and sums sx (row stride k / 32; Q8_16: the halves'
// sums, row stride k / 16).
template <int64_t kFormat, int R>
inline void TileI16(const int16_t* xq, int64_t k, const float* dx, const float* sx,
                    const uint8_t* blocks, float* out, int64_t n, bool stream) {
  constexpr bool kQ4 = kFormat == kQ4_1I16;
  constexpr bool kHalves = kFormat == kQ8_16I16;
  constexpr int64_t kBytes = kQ4 ? kQ4I16Bytes : kHalves ? kQ816I16Bytes : kQ8I16Bytes;
  const int64_t kb = k / kQBlock;
  VN sums[R];
  for (int r = 0; r < R; ++r) sums[r] = VN{};
  for (int64_t b = 0; b < kb; ++b, blocks += kBytes, xq += kQBlock) {
    if (stream) {
      for (int64_t line = 0; line < kBytes; line += kLine)
        __builtin_prefetch(blocks + kI16Ahead + line, 0, 2);
    }
    // Two sums per row (low and high nibbles, even and odd pairs of rows, or Q8_16's halves): a
    // row's chain of dependent multiply-adds is half as long (8 rows: 8 instead of 16 per block).
    IN acc[R], acc2[R];
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = IN{};
    const uint8_t* q = blocks + (kQ4 ? 8 : kHalves ? 16 : 4) * kLanes;
    if constexpr (kHalves) {
      for (int t = 0; t < 8; ++t, q += 2 * kLanes) {
        const IN w = WidenPairs<true>(q), w2 = WidenPairs<true>(q + 16 * kLanes);
        for (int r = 0; r < R; ++r) {
          acc[r] = DotPairs(acc[r], w, xq + r * k + 2 * t);
          acc2[r] = DotPairs(acc2[r], w2, xq + r * k + 16 + 2 * t);
        }
      }
    } else if constexpr (kQ4) {
      for (int t = 0; t < 8; ++t, q += 2 * kLanes) {
        const IN w = WidenPairs<false>(q);
        const IN lo = w & 0x000F000F, hi = (w >> 4) & 0x000F000F;
        for (int r = 0; r < R; ++r) {
          acc[r] = DotPairs(acc[r], lo, xq + r * k + 2 * t);
          acc2[r] = DotPairs(acc2[r], hi, xq + r * k + 16 + 2 * t);
        }
      }
    } else {
      for (int t = 0; t < 16; t += 2, q += 4 * kLanes) {
        const IN w = WidenPairs<true>(q), w2 = WidenPairs<true>(q + 2 * kLanes);
        for (int r = 0; r < R; ++r) {
          acc[r] = DotPairs(acc[r], w, xq + r * k + 2 * t);
          acc2[r] = DotPairs(acc2[r], w2, xq + r * k + 2 * t + 2);
        }
      }
    }
    const float* scales = reinterpret_cast<const float*>(blocks);
    const VN dw = LoadN(scales);
    if constexpr (kHalves) {  // d, m of rows 0-15, then of rows 16-31
      const VN mw = LoadN(scales + kLanes), dw2 = LoadN(scales + 2 * kLanes);
      const VN mw2 = LoadN(scales + 3 * kLanes);
      for (int r = 0; r < R; ++r) {
        const float scale = dx[r * kb + b];
        const float* halves = sx + r * 2 * kb + 2 * b;
        sums[r] += __builtin_convertvector(acc[r], VN) * (dw * scale) + mw * halves[0];
        sums[r] += __builtin_convertvector(acc2[r], VN) * (dw2 * scale) + mw2 * halves[1];
      }
      continue;
    }
    for (int r = 0; r < R; ++r) {
      sums[r] += __builtin_convertvector(acc[r] + acc2[r], VN) * (dw * dx[r * kb + b]);
      if constexpr (kQ4) sums[r] += LoadN(scales + kLanes) * sx[r * kb + b];
    }
  }
  for (int r = 0; r < R; ++r) StoreN(out + r * n, sums[r]);
}

template <int64_t kFormat>
inline void TileI16Of(int64_t rows, const int16_t* xq, int64_t k, const float* dx,
                      const float* sx, const uint8_t* blocks, float* out, int64_t n,
                      bool stream) {
  switch (rows) {
#define JAXTIER_TILE_I16(R) \
  case R: return TileI16<kFormat, R>(xq, k, dx, sx, blocks, out, n, stream);
    JAXTIER_TILE_I16(1) JAXTIER_TILE_I16(2) JAXTIER_TILE_I16(3) JAXTIER_TILE_I16(4)
#if defined(__AVX512F__)
    JAXTIER_TILE_I16(5) JAXTIER_TILE_I16(6) JAXTIER_TILE_I16(7) JAXTIER_TILE_I16(8)
#endif
#undef JAXTIER_TILE_I16
    default: return;
  }
}

// What a call makes of its input rows before any product: nothing (x is the product's input),
// rms_norm(x) (`NormRows`) or silu(gate) * up (`GluRows`) into `rows`.
enum class Prologue { kNone, kNorm, kGlu };

struct Call : jaxtier::Job {
  const float* x;  // the product's input rows [m, k]
  const char* w;
  float* out;
  int64_t format, m, k, n, row_block, row_blocks;
  Prologue prologue = Prologue::kNone;
  const float* source = nullptr;  // the prologue's input: x [m, k] or gate_up [m, 2k]
  const float* scale = nullptr;   // the norm's scale [k] and epsilon
  float eps = 0;
  std::vector<float> rows;  // x made by the prologue (normed rows, silu(gate) * up)
  std::vector<int16_t> xq;  // int16 formats: x quantized, and its block scales and sums
  std::vector<float> dx, sx, sh;  // sh: the halves' sums (Q8_16)
  int64_t panels = 0;
  // The first `row_items` items make the input rows, `item_rows` each (the prologue, then for
  // the int16 formats the quantization); product items wait until all of them are done. Made
  // by one thread, they kept the other cores waiting in every call.
  int64_t row_items = 0, item_rows = 0;
  std::atomic<int64_t> rows_done{0};
  void MakeRows(int64_t first, int64_t last);
  void RunItem(int64_t item) override;
};

void Call::RunItem(int64_t item) {
  if (item < row_items) {
    MakeRows(item * item_rows, std::min(m, (item + 1) * item_rows));
    rows_done.fetch_add(1, std::memory_order_release);
    return;
  }
  // Items are claimed in order, so every row item is claimed and running: wait for them.
  while (rows_done.load(std::memory_order_acquire) < row_items) jaxtier::CpuRelax();
  item -= row_items;
  const int64_t p = item / row_blocks;
  const int64_t first = (item % row_blocks) * row_block;
  const int64_t last = std::min(m, first + row_block);
  const char* panel = w + p * RowBytes(format, k);
  float* dst = out + first * n + p * kPanel;
  // One pass writes the output rows directly; several accumulate in `buffer`, then copy.
  const int64_t step = std::min(kPassRows, k);
  alignas(64) float buffer[kRowBlock * kPanel];
  alignas(64) float rows_w[kPassRows * kPanel];  // a pass of a block format, dequantized
  float* sums = step < k ? buffer : dst;
  const int64_t stride = step < k ? kPanel : n;
  const int64_t rows = last - first;
  if (IsI16(format)) {
    const int64_t kb = k / kQBlock;
    const int64_t tiles = (rows + kTileI16 - 1) / kTileI16;
    const auto tile = format == kQ4_1I16  ? TileI16Of<kQ4_1I16>
                      : format == kQ8_0I16 ? TileI16Of<kQ8_0I16>
                                           : TileI16Of<kQ8_16I16>;
    const bool halves = format == kQ8_16I16;
    for (int64_t q = p * kI16Group; q < std::min(panels, (p + 1) * kI16Group); ++q) {
      const auto* blocks = reinterpret_cast<const uint8_t*>(w + q * RowBytes(format, k));
      for (int64_t t = 0, r = first; t < tiles; ++t) {
        const int64_t height = rows / tiles + (t < rows % tiles);
        const float* sums_x = halves ? sh.data() + r * 2 * kb : sx.data() + r * kb;
        tile(height, xq.data() + r * k, k, dx.data() + r * kb, sums_x, blocks,
             out + r * n + q * kLanes, n, t == 0);
        r += height;
      }
    }
    return;
  }
  const bool prefetching = rows >= kPrefetchFromRows;
  // Tiles of equal height (5 and 6 rows rather than 6 and a lone 2): a short tile's weight loads
  // feed few multiply-adds.
  const int64_t tiles = (rows + kTile - 1) / kTile;
  for (int64_t i0 = 0; i0 < k; i0 += step) {
    const int64_t i1 = std::min(k, i0 + step);
    // The next pass's lines, shared out evenly over this pass's tiles.
    const char* next = panel + RowBytes(format, i1);
    const int64_t lines =
        prefetching ? (RowBytes(format, std::min(k, i1 + step)) - RowBytes(format, i1)) / kLine
                    : 0;
    const float* pass = reinterpret_cast<const float*>(panel + RowBytes(format, i0));
    if (format != kF32 && rows <= kDirectRows) {
      const auto* blocks = reinterpret_cast<const uint8_t*>(panel + RowBytes(format, i0));
      const float* xr = x + first * k + i0;
      if (format == kQ4_1) {
        TileBlocksOf<kQ4_1>(rows, xr, k, blocks, i1 - i0, sums, stride, i0 > 0, next, lines);
      } else if (format == kQ8_0) {
        TileBlocksOf<kQ8_0>(rows, xr, k, blocks, i1 - i0, sums, stride, i0 > 0, next, lines);
      } else {
        TileBlocksOf<kQ8_16>(rows, xr, k, blocks, i1 - i0, sums, stride, i0 > 0, next, lines);
      }
      continue;
    }
    if (format != kF32) {
      for (int64_t b = i0; b < i1; b += kQBlock) {
        const auto* block = reinterpret_cast<const uint8_t*>(panel + RowBytes(format, b));
        if (format == kQ4_1) {
          Dequantize<kQ4_1>(block, rows_w + (b - i0) * kPanel);
        } else if (format == kQ8_0) {
          Dequantize<kQ8_0>(block, rows_w + (b - i0) * kPanel);
        } else {
          Dequantize<kQ8_16>(block, rows_w + (b - i0) * kPanel);
        }
      }
      pass = rows_w;
    }
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int64_t height = rows / tiles + (t < rows % tiles);
      const int64_t line = lines * t / tiles;
      TileOf(height, x + (first + r) * k + i0, k, pass, i1 - i0, sums + r * stride, stride,
             i0 > 0, next + line * kLine, lines * (t + 1) / tiles - line);
      r += height;
    }
  }
  if (sums != dst) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * n, sums + r * kPanel, sizeof(float) * kPanel);
  }
}

// Multiplies call->x [M, K] by w [N/P, K, P] into out [M, N] (shapes checked by the caller).
ffi::Error Multiply(ffi::ThreadPool pool, std::shared_ptr<Call> call, int64_t panels) {
  if (call->m == 0 || call->n == 0) return ffi::Error::Success();
  if (call->k == 0) {
    std::memset(call->out, 0, sizeof(float) * call->m * call->n);
    return ffi::Error::Success();
  }
  // XLA's intra-op thread count caps the helpers, as it does XLA's own kernels.
  const int64_t threads =
      1 + std::min<int64_t>(pool.num_threads(), jaxtier::Crew::Get().size());
  if (call->prologue != Prologue::kNone) {
    call->rows.resize(call->m * call->k);
    call->x = call->rows.data();
  }
  if (IsI16(call->format)) {
    const int64_t blocks = call->m * call->k / kQBlock;
    call->xq.resize(call->m * call->k);
    call->dx.resize(blocks);
    call->sx.resize(blocks);
    if (call->format == kQ8_16I16) call->sh.resize(2 * blocks);
  }
  if (call->prologue != Prologue::kNone || IsI16(call->format)) {
    call->item_rows = (call->m + threads - 1) / threads;
    call->row_items = (call->m + call->item_rows - 1) / call->item_rows;
  }
  call->row_blocks = (call->m + kRowBlock - 1) / kRowBlock;
  call->row_block = (call->m + call->row_blocks - 1) / call->row_blocks;
  call->panels = panels;
  call->items = call->row_items +
                (IsI16(call->format) ? (panels + kI16Group - 1) / kI16Group : panels) *
                    call->row_blocks;
  // The product items in one contiguous range per thread: a thread's weights are one stream, so
  // its prefetches run on across its items (claimed alternately, an item's last prefetches fell
  // into the item the other thread had taken, and every item started cold).
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), call->items - 1);
  call->Split(call->row_items, 1 + std::min<int64_t>(helpers, jaxtier::Crew::Get().size()));
  jaxtier::RunJob(call, helpers);
  return ffi::Error::Success();
}

using Dims = ffi::AnyBuffer::Dimensions;

// Whether w [N/P, K, P] (float32) or [N/P, K/32, kQ4Bytes] (Q4_1, uint8) fits x [M, K] and out
// [M, N] with P the panel width.
bool Fits(const Dims& xd, const ffi::AnyBuffer& w, int64_t format, const Dims& od) {
  const Dims wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || od[0] != xd[0] ||
      od[1] != wd[0] * (IsI16(format) ? kLanes : kPanel))
    return false;
  if (format == kF32)
    return w.element_type() == ffi::F32 && wd[1] == xd[1] && wd[2] == kPanel;
  if (xd[1] % kQBlock || wd[1] * kQBlock != xd[1]) return false;
  if (format == kQ4_1) return w.element_type() == ffi::U8 && wd[2] == kQ4Bytes;
  if (format == kQ8_0) return w.element_type() == ffi::S8 && wd[2] == kQ8Bytes;
  if (format == kQ8_16) return w.element_type() == ffi::U32 && wd[2] * 4 == kQ816Bytes;
  if (format == kQ4_1I16) return w.element_type() == ffi::U16 && wd[2] * 2 == kQ4I16Bytes;
  if (format == kQ8_0I16) return w.element_type() == ffi::S16 && wd[2] * 2 == kQ8I16Bytes;
  return format == kQ8_16I16 && w.element_type() == ffi::S32 && wd[2] * 4 == kQ816I16Bytes;
}

constexpr char kWeightShapes[] =
    "w [N/P, K, P] float32 (format 0), [N/P, K/32, 24 P] uint8 (format 1, Q4_1) or [N/P, K/32, "
    "36 P] int8 (format 2, Q8_0) with P the panel width, or [N/L, K/32, 12 L] uint16 (format 3, "
    "Q4_1 with int16 activations) or [N/L, K/32, 18 L] int16 (format 4, Q8_0 with int16 "
    "activations) with L the vector lanes, or [N/P, K/32, 12 P] uint32 (format 5, 8-bit values "
    "with a scale and minimum per 16 rows), or [N/L, K/32, 12 L] int32 (format 6, the same with "
    "int16 activations)";

void SetWeight(Call& call, const ffi::AnyBuffer& w, int64_t format) {
  call.w = static_cast<const char*>(w.untyped_data());
  call.format = format;
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::ResultBuffer<ffi::F32> out, int64_t format) {
  if (!Fits(x.dimensions(), w, format, out->dimensions()))
    return ffi::Error::InvalidArgument(std::string("packed matmul: expected x [M, K], ") +
                                       kWeightShapes + ", out [M, N]");
  auto call = std::make_shared<Call>();
  call->x = x.typed_data();
  SetWeight(*call, w, format);
  call->out = out->typed_data();
  call->m = x.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = out->dimensions()[1];
  return Multiply(pool, call, w.dimensions()[0]);
}

// rms_norm(x) @ w, with rms_norm(x)[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * scale, float32,
// in the order jaxtier.model.RMSNorm computes it, for rows [first, last): the call's row items
// normalize every row once into a buffer the call owns; all threads then multiply from it. This
// saves XLA two small ops per norm (a reduction and a multiply), each of which took longer at
// decode sizes than the math.
void NormRows(const float* x, const float* scale, float eps, int64_t k, float* rows,
              int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const float* row = x + r * k;
    float* dst = rows + r * k;
    V16 lanes{};  // 16 partial sums of squares (XLA sums in its own order too)
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      const V16 v = LoadV(row + i);
      lanes += v * v;
    }
    float sum = jaxtier::Sum16(lanes);
    for (; i < k; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(k) + eps);
    for (int64_t i = 0; i < k; ++i) dst[i] = scale[i] * (row[i] * inv);
  }
}

// silu(gate) * up for rows [first, last) of gate_up [m, 2k] into rows [m, k], with silu(g) =
// g / (1 + exp(-g)).
void GluRows(const float* gate_up, int64_t k, float* rows, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const float* gate = gate_up + r * 2 * k;
    const float* up = gate + k;
    float* dst = rows + r * k;
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      const VN g = LoadN(gate + i);
      StoreN(dst + i, g / (1.0f + jaxtier::Exp(-g)) * LoadN(up + i));
    }
    for (; i < k; ++i) dst[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

void Call::MakeRows(int64_t first, int64_t last) {
  if (prologue == Prologue::kNorm) NormRows(source, scale, eps, k, rows.data(), first, last);
  if (prologue == Prologue::kGlu) GluRows(source, k, rows.data(), first, last);
  if (IsI16(format)) {
    const int64_t kb = k / kQBlock;
    QuantizeRows(x + first * k, last - first, k, xq.data() + first * k, dx.data() + first * kb,
                 sx.data() + first * kb, sh.empty() ? nullptr : sh.data() + first * 2 * kb);
  }
}

// Sets `call` to make its input rows as rms_norm(x) (NormRows) in its row items.
void SetNorm(Call& call, const float* x, const float* scale, float eps) {
  call.prologue = Prologue::kNorm;
  call.source = x;
  call.scale = scale;
  call.eps = eps;
}

ffi::Error NormPackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::F32> scale, ffi::AnyBuffer w,
                                ffi::ResultBuffer<ffi::F32> out, float eps, int64_t format) {
  if (!Fits(x.dimensions(), w, format, out->dimensions()) || scale.dimensions().size() != 1 ||
      scale.dimensions()[0] != x.dimensions()[1])
    return ffi::Error::InvalidArgument(std::string("norm packed matmul: expected x [M, K], "
                                                   "scale [K], ") + kWeightShapes +
                                       ", out [M, N]");
  auto call = std::make_shared<Call>();
  call->m = x.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = out->dimensions()[1];
  SetNorm(*call, x.typed_data(), scale.typed_data(), eps);
  SetWeight(*call, w, format);
  call->out = out->typed_data();
  return Multiply(pool, call, w.dimensions()[0]);
}

// Adds the bias and applies the rotary embedding to rows [kRopeRows item, ...) of a product.
constexpr int64_t kRopeRows = 64;
struct RopeRows : jaxtier::Job {
  float* out;
  const float *bias, *cos, *sin;
  int64_t m, n, d, rotary_columns;
  void RunItem(int64_t item) override {
    const int64_t half = d / 2;
    for (int64_t r = item * kRopeRows; r < std::min(m, (item + 1) * kRopeRows); ++r) {
      float* row = out + r * n;
      if (bias) {
        for (int64_t c = 0; c < n; ++c) row[c] += bias[c];
      }
      const float* c_r = cos + r * d;
      const float* s_r = sin + r * d;
      for (int64_t head = 0; head < rotary_columns; head += d) {
        float* lo = row + head;
        float* hi = lo + half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = lo[j], b = hi[j];
          lo[j] = a * c_r[j] - b * s_r[j];
          hi[j] = b * c_r[half + j] + a * s_r[half + j];
        }
      }
    }
  }
};

// The q/k/v projection of a decoder layer: rms_norm(x) @ w + bias, then the rotary embedding of
// the first `rotary_columns` columns (the query and key heads) in heads of d = cos's width, the
// Hugging Face `rotate_half` convention: out[:d/2] = a cos - b sin, out[d/2:] = b cos + a sin for
// a head's halves a, b and its row's cos and sin [d]. Applied once every panel is done (a head
// spans several panels), in blocks of rows shared with the crew. In XLA the rotary embeddings of
// q and of k were two more elementwise ops per layer that recomputed cos and sin in each (XLA
// fuses the tables' sin and cos into every consumer).
ffi::Error NormRopePackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                    ffi::Buffer<ffi::F32> scale, ffi::AnyBuffer w,
                                    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> cos,
                                    ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> out,
                                    float eps, int64_t rotary_columns, int64_t format) {
  const auto cd = cos.dimensions();
  const int64_t m = x.dimensions().size() == 2 ? x.dimensions()[0] : -1;
  const int64_t n = out->dimensions().size() == 2 ? out->dimensions()[1] : -1;
  const int64_t d = cd.size() == 2 ? cd[1] : 0;
  if (!Fits(x.dimensions(), w, format, out->dimensions()) ||
      scale.dimensions().size() != 1 || scale.dimensions()[0] != x.dimensions()[1] ||
      bias.dimensions().size() != 1 || (bias.dimensions()[0] != n && bias.dimensions()[0] != 0) ||
      cd.size() != 2 || cd[0] != m || d == 0 || d % 2 || !(sin.dimensions() == cd) ||
      rotary_columns % d || rotary_columns < 0 || rotary_columns > n)
    return ffi::Error::InvalidArgument(
        std::string("norm rope packed matmul: expected x [M, K], scale [K], ") + kWeightShapes +
        ", bias [N] or [0], cos and sin [M, d] with d even, out [M, N], and rotary columns a "
        "multiple of d up to N");
  auto call = std::make_shared<Call>();
  call->m = m;
  call->k = x.dimensions()[1];
  call->n = n;
  SetNorm(*call, x.typed_data(), scale.typed_data(), eps);
  SetWeight(*call, w, format);
  call->out = out->typed_data();
  if (ffi::Error error = Multiply(pool, call, w.dimensions()[0]); error.failure()) return error;
  auto rope = std::make_shared<RopeRows>();
  rope->out = call->out;
  rope->bias = bias.dimensions()[0] ? bias.typed_data() : nullptr;
  rope->cos = cos.typed_data();
  rope->sin = sin.typed_data();
  rope->m = m;
  rope->n = n;
  rope->d = d;
  rope->rotary_columns = rotary_columns;
  rope->items = (m + kRopeRows - 1) / kRopeRows;
  jaxtier::RunJob(rope, std::min<int64_t>(pool.num_threads(), rope->items - 1));
  return ffi::Error::Success();
}

// (silu(gate) * up) @ w for gate_up = [gate | up] of K columns each, silu(g) = g / (1 + exp(-g)):
// a SwiGLU MLP's down projection with its gating. The call's row items compute every row's
// product once into a buffer the call owns (GluRows, vector exp); all threads then multiply from
// it. In XLA:CPU the gating is an elementwise op that it splits over two threads, and at decode
// sizes it waited longer for the second thread than the math takes.
ffi::Error GluPackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate_up,
                               ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> out,
                               int64_t format) {
  const auto gd = gate_up.dimensions();
  const int64_t xd[2] = {gd.size() == 2 ? gd[0] : 0, gd.size() == 2 ? gd[1] / 2 : 0};
  if (gd.size() != 2 || gd[1] % 2 || !Fits(Dims(xd, 2), w, format, out->dimensions()))
    return ffi::Error::InvalidArgument(std::string("glu packed matmul: expected gate_up [M, 2K], ")
                                       + kWeightShapes + ", out [M, N]");
  auto call = std::make_shared<Call>();
  call->m = gd[0];
  call->k = gd[1] / 2;
  call->n = out->dimensions()[1];
  call->prologue = Prologue::kGlu;
  call->source = gate_up.typed_data();
  SetWeight(*call, w, format);
  call->out = out->typed_data();
  return Multiply(pool, call, w.dimensions()[0]);
}

}  // namespace

// The panel width P the handlers expect (jaxtier.kernels.cpu.matmul packs for it).
extern "C" int JaxtierPanelWidth() { return kPanel; }

// Columns per panel of the int16-activation formats (the lanes of a vector).
extern "C" int JaxtierLanes() { return kLanes; }

// 1 where the int16-activation formats' pair products run in vector instructions (`DotPairs`:
// AVX512-VNNI, AVX512BW or AVX2), 0 where they fall back to a scalar loop.
extern "C" int JaxtierIntegerDots() {
#if defined(__AVX512BW__) || (defined(__AVX2__) && !defined(__AVX512F__))
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierNormPackedMatmul, NormPackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierNormRopePackedMatmul, NormRopePackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("rotary_columns")
                                  .Attr<int64_t>("format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtierGluPackedMatmul, GluPackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("format"));
