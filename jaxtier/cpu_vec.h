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

// The sum of the 16 lanes.
inline float Sum16(V16 v) {
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += v[l];
  return sum;
}

}  // namespace jaxtier

#endif  // JAXTIER_CPU_VEC_H_
