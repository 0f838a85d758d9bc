// 16-lane float and int32 vectors (GCC/Clang vector extensions) for jaxtier's CPU kernels: one
// AVX-512 register each where the CPU has it, two or four narrower ones elsewhere.

#ifndef JAXTIER_CPU_VEC_H_
#define JAXTIER_CPU_VEC_H_

#include <cstdint>
#include <cstring>

namespace jaxtier {

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

// Unaligned loads and stores of 16 floats.
inline V16 LoadV(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreV(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of the 16 lanes.
inline float Sum16(V16 v) {
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += v[l];
  return sum;
}

}  // namespace jaxtier

#endif  // JAXTIER_CPU_VEC_H_
