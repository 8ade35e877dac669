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

// Which columns of B a 6 × 16 tile loads: all 16, the first `nc` ≤ 8 (one register, masked),
// or 8 and then `nc` − 8 masked.
enum class Cols { All, Low, High };

// The 6 × 16 tile's sums: acc[2r], acc[2r + 1] = Σ_{k < K} A(r, k)·B(k, 0 … 15) with
// A(r, k) = rows[r][k·ak], B as in `micro_tile`.
template <Cols kCols>
__attribute__((target("avx2,fma"), always_inline)) inline void tile_6x16(
    int64_t K,
    const float* const (&rows)[6],
    int64_t ak,
    const float* b,
    int64_t bs,
    int nc,
    __m256 (&acc)[12]) {
  for (int i = 0; i < 12; ++i) {
    acc[i] = _mm256_setzero_ps();
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lanes);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc - 8), lanes);
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * bs;
    const __m256 b0 = kCols == Cols::Low ? _mm256_maskload_ps(bk, lo) : _mm256_loadu_ps(bk);
    const __m256 b1 = kCols == Cols::All ? _mm256_loadu_ps(bk + 8)
        : kCols == Cols::High            ? _mm256_maskload_ps(bk + 8, hi)
                                         : _mm256_setzero_ps();
    const int64_t o = k * ak;
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const __m256 x = _mm256_broadcast_ss(rows[r] + o);
      acc[2 * r] = _mm256_fmadd_ps(x, b0, acc[2 * r]);
      if (kCols != Cols::Low) {
        acc[2 * r + 1] = _mm256_fmadd_ps(x, b1, acc[2 * r + 1]);
      }
    }
  }
}

// One 6 × 16 tile: C[r][c] = alpha · Σ_{k < K} A(r, k)·B(k, c) + Cin[r][c] (Cin absent when
// `cin` is null; `cin` may equal `c`), where A(r, k) = a[r·ar + k·ak], B(k, c) = b[k·bs + c],
// C[r][c] = c[r·cs + c] and Cin[r][c] = cin[r·cins + c]. Only the first `mr` (1 … 6) rows of A
// are read and the first `nc` (1 … 16) columns of B: with `nc` < 16 B is read with masked loads,
// which touch no memory past column `nc`, unless `b16` says that 16 columns of B are readable
// (padded rows). Only the first `mr` rows and `nc` columns of C are written.
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
  __m256 acc[12];
  const float* rows[6];
  for (int r = 0; r < 6; ++r) {
    // rows past `mr` read row 0 again (their results are dropped)
    rows[r] = a + (r < mr ? r : 0) * ar;
  }
  if (nc == 16 || b16) {
    tile_6x16<Cols::All>(K, rows, ak, b, bs, nc, acc);
  } else if (nc <= 8) {
    tile_6x16<Cols::Low>(K, rows, ak, b, bs, nc, acc);
  } else {
    tile_6x16<Cols::High>(K, rows, ak, b, bs, nc, acc);
  }
  const __m256 al = _mm256_set1_ps(alpha);
  if (mr == 6 && nc == 16) {
    for (int r = 0; r < 6; ++r) {
      float* cr = c + r * cs;
      __m256 x0 = _mm256_mul_ps(al, acc[2 * r]), x1 = _mm256_mul_ps(al, acc[2 * r + 1]);
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
    _mm256_store_ps(t + 8 * i, _mm256_mul_ps(al, acc[i]));
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
  __m256 acc[12];
  const float* rows[12];
  for (int r = 0; r < 12; ++r) {
    acc[r] = _mm256_setzero_ps();
    rows[r] = a + (r < mr ? r : 0) * ar;
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lanes);
  for (int64_t k = 0; k < K; ++k) {
    const __m256 bk = nc == 8 ? _mm256_loadu_ps(b + k * bs) : _mm256_maskload_ps(b + k * bs, mask);
    const int64_t o = k * ak;
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(rows[r] + o), bk, acc[r]);
    }
  }
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
