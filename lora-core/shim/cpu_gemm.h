// Register-blocked f32 products for x86-64 CPUs with AVX2 and FMA, shared by the shim's CPU
// kernels (attention.cpp, lora_branch.cpp). One tile is 6 rows × 16 columns of the result held
// in twelve 8-float registers; each step of the summed dimension broadcasts one value of each
// of the 6 rows of A and multiplies it into 16 columns of B (12 FMAs for 2 loads and 6
// broadcasts), the classic outer-product micro-kernel of register-blocked GEMMs (Goto and van de
// Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 34(3), 2008). Operands
// are read through strides, so transposed operands need no copy; nothing is packed.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LSDK_CPU_GEMM 1
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace lsdk {

// Whether this build and CPU run the AVX2/FMA products below.
inline bool cpu_gemm_available() {
#ifdef LSDK_CPU_GEMM
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

#ifdef LSDK_CPU_GEMM

// One 6 × 16 tile: C[r][c] = alpha · Σ_{k < K} A(r, k)·B(k, c) + Cin[r][c] (Cin absent when
// `cin` is null; `cin` may equal `c`), where A(r, k) = a[r·ar + k·ak], B(k, c) = b[k·bs + c],
// C[r][c] = c[r·cs + c] and Cin[r][c] = cin[r·cins + c]. Only the first `mr` (1 … 6) rows of A
// are read and the first `nc` (1 … 16) columns of B: with `nc` < 16 B is read with masked loads,
// which touch no memory past column `nc`, unless `b16` says that 16 columns of B are readable
// (padded rows). Only the first `mr` rows and `nc` columns of C are written. The loop is
// written out for each way of loading B, with named accumulators: one loop templated over the
// load, its accumulators in an array, made the attention kernel 2× slower (GCC kept the array
// on the stack and stored it after every FMA).
__attribute__((target("avx2,fma"))) inline void micro_tile(
    int64_t K,
    const float* a,
    int64_t ar,
    int64_t ak,
    const float* b,
    int64_t bs,
    float* c,
    int64_t cs,
    const float* cin,
    int64_t cins,
    int mr,
    int nc,
    float alpha,
    bool b16 = false) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // rows past `mr` read row 0 again (their results are dropped)
  const float* a0 = a;
  const float* a1 = mr > 1 ? a + ar : a;
  const float* a2 = mr > 2 ? a + 2 * ar : a;
  const float* a3 = mr > 3 ? a + 3 * ar : a;
  const float* a4 = mr > 4 ? a + 4 * ar : a;
  const float* a5 = mr > 5 ? a + 5 * ar : a;
  if (nc == 16 || b16) {
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * bs), b1 = _mm256_loadu_ps(b + k * bs + 8);
      const int64_t o = k * ak;
      __m256 x = _mm256_broadcast_ss(a0 + o);
      c00 = _mm256_fmadd_ps(x, b0, c00);
      c01 = _mm256_fmadd_ps(x, b1, c01);
      x = _mm256_broadcast_ss(a1 + o);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
      x = _mm256_broadcast_ss(a2 + o);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
      x = _mm256_broadcast_ss(a3 + o);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
      x = _mm256_broadcast_ss(a4 + o);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
      x = _mm256_broadcast_ss(a5 + o);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  } else if (nc <= 8) {
    // one register column: lanes ≥ nc masked off
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lanes);
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_maskload_ps(b + k * bs, m0);
      const int64_t o = k * ak;
      c00 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + o), b0, c00);
      c10 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + o), b0, c10);
      c20 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + o), b0, c20);
      c30 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + o), b0, c30);
      c40 = _mm256_fmadd_ps(_mm256_broadcast_ss(a4 + o), b0, c40);
      c50 = _mm256_fmadd_ps(_mm256_broadcast_ss(a5 + o), b0, c50);
    }
  } else {
    const __m256i lanes = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lanes);
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * bs), b1 = _mm256_maskload_ps(b + k * bs + 8, m1);
      const int64_t o = k * ak;
      __m256 x = _mm256_broadcast_ss(a0 + o);
      c00 = _mm256_fmadd_ps(x, b0, c00);
      c01 = _mm256_fmadd_ps(x, b1, c01);
      x = _mm256_broadcast_ss(a1 + o);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
      x = _mm256_broadcast_ss(a2 + o);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
      x = _mm256_broadcast_ss(a3 + o);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
      x = _mm256_broadcast_ss(a4 + o);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
      x = _mm256_broadcast_ss(a5 + o);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
  const __m256 rows[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  if (mr == 6 && nc == 16) {
    for (int r = 0; r < 6; ++r) {
      float* cr = c + r * cs;
      __m256 x0 = _mm256_mul_ps(al, rows[2 * r]), x1 = _mm256_mul_ps(al, rows[2 * r + 1]);
      if (cin != nullptr) {
        const float* ir = cin + r * cins;
        x0 = _mm256_add_ps(x0, _mm256_loadu_ps(ir));
        x1 = _mm256_add_ps(x1, _mm256_loadu_ps(ir + 8));
      }
      _mm256_storeu_ps(cr, x0);
      _mm256_storeu_ps(cr + 8, x1);
    }
    return;
  }
  alignas(32) float t[96];
  for (int i = 0; i < 12; ++i) {
    _mm256_store_ps(t + 8 * i, _mm256_mul_ps(al, rows[i]));
  }
  for (int r = 0; r < mr; ++r) {
    for (int j = 0; j < nc; ++j) {
      c[r * cs + j] = cin != nullptr ? cin[r * cins + j] + t[r * 16 + j] : t[r * 16 + j];
    }
  }
}

// A 12 × 8 tile for products at most 8 columns wide (a LoRA rank): C as in `micro_tile` with
// `mr` (1 … 12) rows and `nc` (1 … 8) columns, B read with a masked load when `nc` < 8. Twelve
// rows keep twelve accumulators busy where the 6 × 16 tile would leave half its registers on
// columns that do not exist.
__attribute__((target("avx2,fma"))) inline void micro_tile_n8(
    int64_t K,
    const float* a,
    int64_t ar,
    int64_t ak,
    const float* b,
    int64_t bs,
    float* c,
    int64_t cs,
    const float* cin,
    int64_t cins,
    int mr,
    int nc,
    float alpha) {
  // twelve named accumulators: in an array GCC kept them on the stack, storing after every FMA
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m256 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  auto row = [&](int r) { return a + (r < mr ? r : 0) * ar; };
  const float *a0 = row(0), *a1 = row(1), *a2 = row(2), *a3 = row(3), *a4 = row(4), *a5 = row(5);
  const float *a6 = row(6), *a7 = row(7), *a8 = row(8), *a9 = row(9), *a10 = row(10), *a11 = row(11);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lanes);
  for (int64_t k = 0; k < K; ++k) {
    const __m256 bk = nc == 8 ? _mm256_loadu_ps(b + k * bs) : _mm256_maskload_ps(b + k * bs, mask);
    const int64_t o = k * ak;
    c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + o), bk, c0);
    c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + o), bk, c1);
    c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + o), bk, c2);
    c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + o), bk, c3);
    c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(a4 + o), bk, c4);
    c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(a5 + o), bk, c5);
    c6 = _mm256_fmadd_ps(_mm256_broadcast_ss(a6 + o), bk, c6);
    c7 = _mm256_fmadd_ps(_mm256_broadcast_ss(a7 + o), bk, c7);
    c8 = _mm256_fmadd_ps(_mm256_broadcast_ss(a8 + o), bk, c8);
    c9 = _mm256_fmadd_ps(_mm256_broadcast_ss(a9 + o), bk, c9);
    c10 = _mm256_fmadd_ps(_mm256_broadcast_ss(a10 + o), bk, c10);
    c11 = _mm256_fmadd_ps(_mm256_broadcast_ss(a11 + o), bk, c11);
  }
  const __m256 acc[12] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  const __m256 al = _mm256_set1_ps(alpha);
  for (int r = 0; r < mr; ++r) {
    __m256 v = _mm256_mul_ps(al, acc[r]);
    float* cr = c + r * cs;
    if (nc == 8) {
      if (cin != nullptr) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(cin + r * cins));
      }
      _mm256_storeu_ps(cr, v);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, v);
      for (int j = 0; j < nc; ++j) {
        cr[j] = cin != nullptr ? cin[r * cins + j] + t[j] : t[j];
      }
    }
  }
}

// Length of the runs of the summed dimension that `strided_product` sums in registers.
constexpr int64_t kChunk = 64;

// C = alpha · A·B + Cin over a whole M × N result (strides as in `micro_tile`; `cin` null for
// none), as 6 × 16 tiles (12 × 8 when N ≤ 8). With `parallel`, the tiles are shared among libtorch's intra-op
// threads (`at::parallel_for`), each task a run of whole tiles; K = 0 gives C = Cin (or 0).
__attribute__((target("avx2,fma"))) inline void strided_product(
    int64_t M,
    int64_t N,
    int64_t K,
    const float* a,
    int64_t ar,
    int64_t ak,
    const float* b,
    int64_t bs,
    float* c,
    int64_t cs,
    const float* cin,
    int64_t cins,
    float alpha,
    bool parallel) {
  if (M <= 0 || N <= 0) {
    return;
  }
  // 6 × 16 tiles, or 12 × 8 ones for a product at most 8 columns wide
  const bool narrow = N <= 8;
  const int64_t tm = narrow ? 12 : 6, tn = narrow ? 8 : 16;
  const int64_t mb = (M + tm - 1) / tm, nb = (N + tn - 1) / tn;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / nb * tm, n0 = t % nb * tn;
      const int mr = static_cast<int>(std::min<int64_t>(tm, M - m0));
      const int nc = static_cast<int>(std::min<int64_t>(tn, N - n0));
      float* ct = c + m0 * cs + n0;
      const float* it = cin != nullptr ? cin + m0 * cins + n0 : nullptr;
      if (K <= 0) {
        for (int r = 0; r < mr; ++r) {
          for (int j = 0; j < nc; ++j) {
            ct[r * cs + j] = it != nullptr ? it[r * cins + j] : 0.0f;
          }
        }
        continue;
      }
      // the sum in runs of kChunk: each run's partial sum is rounded and added to C once,
      // which bounds the rounding error of a long sum by ≈ (kChunk + K / kChunk)·ε instead of
      // K·ε (blocked summation, Higham, "Accuracy and Stability of Numerical Algorithms",
      // 2nd ed., §4.2)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kn = std::min(kChunk, K - k0);
        const float* ak0 = a + m0 * ar + k0 * ak;
        const float* bk0 = b + k0 * bs + n0;
        const float* in = k0 == 0 ? it : ct;
        const int64_t ins = k0 == 0 ? cins : cs;
        if (narrow) {
          micro_tile_n8(kn, ak0, ar, ak, bk0, bs, ct, cs, in, ins, mr, nc, alpha);
        } else {
          micro_tile(kn, ak0, ar, ak, bk0, bs, ct, cs, in, ins, mr, nc, alpha);
        }
      }
    }
  };
  if (!parallel) {
    run(0, mb * nb);
    return;
  }
  // at least ≈ 64 Ki multiply-adds per task, so that short products stay on one thread
  const int64_t per_tile = tm * tn * std::max<int64_t>(K, 1);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_tile);
  at::parallel_for(0, mb * nb, grain, run);
}

#endif  // LSDK_CPU_GEMM

}  // namespace lsdk
