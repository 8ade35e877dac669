// Vectorizable f32 math shared by the shim's CPU loops (decoder_ops.cpp, attention.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace lsdk {

// e^x in f32, branch-free so that it vectorizes: x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 split in
// two parts, Cody and Waite's reduction), e^r by a degree-7 polynomial (the coefficients of
// Cephes' `expf`, S. L. Moshier), times 2^n as two powers of two written into exponent bits (each
// a normal float for every n in range). x is clamped to [−104, 89], beyond which e^x rounds to 0
// or overflows to +∞ anyway, so it saturates as `expf` does (subnormals included); NaN passes
// through. Then `x / (1 + e^−x)` is −0 for a very negative x and NaN for −∞, as libtorch's `silu`.
inline float exp_f32(float x) {
  float c = x < -104.0f ? -104.0f : x;
  c = c > 89.0f ? 89.0f : c;
  // n = round(c / ln 2) by the 1.5·2²³ trick (adding it leaves no fraction bits to round)
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n = 2^n1 · 2^n2 with n1 = ⌊n / 2⌋: both in [−75, 65], normal floats
  // (a NaN x makes n NaN, whose conversion is undefined: 0 instead; p carries the NaN)
  const int32_t ni = static_cast<int32_t>(n == n ? n : 0.0f);
  const int32_t n1 = ni >> 1;
  const int32_t b1 = (n1 + 127) << 23;
  const int32_t b2 = (ni - n1 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  return (p * s1) * s2;
}

}  // namespace lsdk
