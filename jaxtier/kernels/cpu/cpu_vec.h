// Float and int32 vectors (GCC/Clang vector extensions) for jaxtier's CPU kernels: 16-lane ones
// (one AVX-512 register where the CPU has it, two or four narrower ones elsewhere) and `VN`, the
// widest register the build has, which register tiles are sized by.

#ifndef JAXTIER_CPU_VEC_H_
#define JAXTIER_CPU_VEC_H_

#include <cstdint>
#include <cstring>

namespace jaxtier {

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

// Lanes of the widest float register: AVX-512 (32 registers of 16 floats) where the build has it,
// else 8 (AVX2's 16 registers of 8 floats; two NEON registers).
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif
typedef float VN __attribute__((vector_size(4 * kNativeLanes)));
typedef int32_t IN __attribute__((vector_size(4 * kNativeLanes)));

// Unaligned loads and stores of 16 floats.
inline V16 LoadV(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreV(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

// Unaligned loads and stores of one VN.
inline VN LoadN(const float* p) {
  VN v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreN(float* p, VN v) { std::memcpy(p, &v, sizeof(v)); }

// exp of a VN's lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r,
// times 2^n from the exponent bits; about 1 ulp). Lanes below -87.3 give ~1e-38 instead of 0 and
// lanes above 88.37 give ~2.4e38 instead of inf: softmax arguments are x - max <= 0, so the first
// only ever meets a sum of at least 1, and silu's x / (1 + exp(-x)) stays within 1e-35 of its
// limits. The scalar std::exp was most of the softmax at long contexts (slots x query heads calls
// per item).
inline VN Exp(VN x) {
  const VN lo = VN{} - 87.33654f, hi = VN{} + 88.3762626647949f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const VN fx = x * 1.44269504088896341f + 0.5f;
  IN n = __builtin_convertvector(fx, IN);  // truncates toward zero
  VN nf = __builtin_convertvector(n, VN);
  const IN over = nf > fx;                 // -1 where truncation rounded up: floor instead
  n += over;
  nf = __builtin_convertvector(n, VN);
  const VN r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  VN y = VN{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  VN scale;
  const IN bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// The sum of the 16 lanes.
inline float Sum16(V16 v) {
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += v[l];
  return sum;
}

}  // namespace jaxtier

#endif  // JAXTIER_CPU_VEC_H_
