// Causal self-attention for short f32 sequences on x86-64 CPUs with AVX2 and FMA, forward and
// backward, for the LLaMA-family training step: `out = softmax(q·kᵀ·scale + causal) · v` with
// grouped keys/values (query head h reads kv head h / (heads / kv_heads), HF's `repeat_kv`
// without the copy), the semantics of SDPA's `is_causal` for equal query and key lengths.
//
// libtorch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) tiles keys for
// any length; at the lengths a CPU trains on (a few hundred tokens) its per-block bookkeeping
// costs more than the products: `[2, 9, 128, 64]` with 3 kv heads took 3.5 ms forward and
// backward on a 2-core AVX2 EPYC, against 2.0 ms here. This kernel keeps a whole `[s, s]` block
// of probabilities per head in a workspace instead (at most `kMaxSeq` rows), so every product is
// a plain register-blocked GEMM over 6 × 16 tiles:
//
//   forward, per (batch, head):   S = q·kᵀ·scale (rows i, keys j ≤ i), P = softmax(S),
//                                 lse_i = max_j S_ij + log Σ_j e^(S_ij − max), out = P·v;
//   backward, per (batch, kv head), its query heads in turn (the standard softmax-attention
//   gradients, as in Dao et al. 2022, "FlashAttention", algorithm 4, without the tiling):
//                                 P = e^(q·kᵀ·scale − lse), dP = dout·vᵀ,
//                                 D_i = Σ_d dout_id · out_id, dS = P ⊙ (dP − D)·scale,
//                                 dq = dS·k, dk += dSᵀ·q, dv += Pᵀ·dout.
//
// Saved for the backward pass: q, k, v, out and lse (`[b, h, s]` f32), what the flash kernel
// saves. `out` is returned `[b, s, h, d]` (the flash kernel's storage order), so that the
// `[b, s, h·d]` view the output projection reads is no copy. The workspace is one tensor per
// worker of libtorch's intra-op pool (`d·sₚ + sₚ²` floats forward, `2·d·sₚ + 2·sₚ² + s` backward;
// sₚ = s rounded up to 16: up to 3 MiB at s = 512, d = 256), allocated through libtorch's CPU
// allocator. The forward pass runs in parallel over (sequence, head) tasks, the backward over
// (sequence, kv head). Values equal the f64 composite up to f32 rounding: relative differences
// of about 1e-6 (`cargo test -p lora-core --test core causal_attention`). The node refuses to
// run its backward pass after a saved tensor was changed in place, and has no double backward.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "cpu_gemm.h"
#include "cpu_math.h"
#include "guard.h"


#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>

namespace {

// Longest sequence and largest head size the kernel takes (the caller falls back to libtorch's).
constexpr int64_t kMaxSeq = 512;
constexpr int64_t kMaxHeadDim = 256;

bool kernel_available() {
  return lsdk::cpu_gemm_available();
}

#ifdef LSDK_CPU_GEMM

// Which part of the summed dimension a block of rows m0 .. m1 of a product reads.
enum class KRange {
  All,        // every k < K
  UpToRow,    // k < m1 (P·v, dS·k: keys after the block's last query have P = dS = 0)
  FromRow,    // k ≥ m0 (Pᵀ·dout, dSᵀ·q: queries before the block's first key have P = dS = 0)
};

// C[M][N] = alpha · Σ_k A(m, k)·B(k, n) (+ C with `acc`), A and B as in `micro_tile`, K the full
// summed length. N is a multiple of 16 or the rows of B are padded to the next one.
__attribute__((target("avx2,fma"))) void tiled_product(
    int64_t M,
    int64_t N,
    int64_t K,
    KRange range,
    const float* a,
    int64_t ar,
    int64_t ak,
    const float* b,
    int64_t bs,
    float* c,
    int64_t cs,
    bool acc,
    float alpha) {
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    const int mr = static_cast<int>(std::min<int64_t>(6, M - m0));
    int64_t k0 = 0, k1 = K;
    if (range == KRange::UpToRow) {
      k1 = std::min(K, m0 + mr);
    } else if (range == KRange::FromRow) {
      k0 = m0;
    }
    const int64_t kn = k1 - k0;
    const float* ablk = a + m0 * ar + k0 * ak;
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      const int nc = static_cast<int>(std::min<int64_t>(16, N - n0));
      if (kn <= 0) {
        if (!acc) {
          for (int r = 0; r < mr; ++r) {
            std::fill_n(c + (m0 + r) * cs + n0, nc, 0.0f);
          }
        }
        continue;
      }
      float* ct = c + m0 * cs + n0;
      lsdk::micro_tile(kn, ablk, ar, ak, b + k0 * bs + n0, bs, ct, cs, acc ? ct : nullptr, cs, mr, nc, alpha, true);
    }
  }
}

// row[j] = e^(row[j] − m) for j < n; returns Σ_j row[j].
__attribute__((target("avx2,fma"))) float exp_shifted(float* row, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = lsdk::exp_f32(row[j] - m);
    row[j] = e;
    sum += e;
  }
  return sum;
}

// kᵀ of one kv head into `kt` `[d, sp]` (columns s .. sp zero).
void transpose_rows(const float* k, int64_t ks, int64_t S, int64_t D, int64_t Sp, float* kt) {
  for (int64_t d = 0; d < D; ++d) {
    float* dst = kt + d * Sp;
    for (int64_t j = 0; j < S; ++j) {
      dst[j] = k[j * ks + d];
    }
    std::fill(dst + S, dst + Sp, 0.0f);
  }
}

struct Strides {
  int64_t b, h, s;
  explicit Strides(const at::Tensor& t) : b(t.stride(0)), h(t.stride(1)), s(t.stride(2)) {}
  int64_t at(int64_t bi, int64_t hi) const {
    return bi * b + hi * h;
  }
};

int64_t padded(int64_t s) {
  return (s + 15) / 16 * 16;
}

// out `[b, s, h, d]` and lse `[b, h, s]`.
std::pair<at::Tensor, at::Tensor> forward_values(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t rep = H / Hkv, Sp = padded(S);
  at::Tensor out = at::empty({B, S, H, D}, q.options());
  at::Tensor lse = at::empty({B, H, S}, q.options());
  const Strides qs(q), ks(k), vs(v), os(out.transpose(1, 2));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor work = at::empty({D * Sp + Sp * Sp}, q.options());
    float* kt = work.data_ptr<float>();
    float* p = kt + D * Sp;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / H, h = t % H, g = h / rep;
      const float* Q = qp + qs.at(bi, h);
      const float* K = kp + ks.at(bi, g);
      const float* V = vp + vs.at(bi, g);
      float* O = op + os.at(bi, h);
      float* L = lp + (bi * H + h) * S;
      transpose_rows(K, ks.s, S, D, Sp, kt);
      // scores of each block of 6 queries against the keys up to its last query
      for (int64_t m0 = 0; m0 < S; m0 += 6) {
        const int64_t mr = std::min<int64_t>(6, S - m0);
        tiled_product(mr, m0 + mr, D, KRange::All, Q + m0 * qs.s, qs.s, 1, kt, Sp, p + m0 * Sp, Sp, false, scale);
      }
      for (int64_t i = 0; i < S; ++i) {
        float* row = p + i * Sp;
        float mx = row[0];
        for (int64_t j = 1; j <= i; ++j) {
          mx = std::max(mx, row[j]);
        }
        const float sum = exp_shifted(row, i + 1, mx);
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] *= inv;
        }
        std::fill(row + i + 1, row + Sp, 0.0f);
        L[i] = mx + std::log(sum);
      }
      tiled_product(S, D, Sp, KRange::UpToRow, p, Sp, 1, V, vs.s, O, os.s, false, 1.0f);
    }
  });
  return {out, lse};
}

// dq `[b, h, s, d]`, dk and dv `[b, kv, s, d]`, contiguous; `out` and `gout` `[b, h, s, d]` (any
// strides with a contiguous last dim).
std::array<at::Tensor, 3> backward_values(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& out,
    const at::Tensor& lse,
    const at::Tensor& gout,
    float scale,
    std::array<bool, 3> need) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t rep = H / Hkv, Sp = padded(S);
  const bool need_ds = need[0] || need[1];
  at::Tensor dq = need[0] ? at::empty({B, H, S, D}, q.options()) : at::Tensor();
  at::Tensor dk = need[1] ? at::empty({B, Hkv, S, D}, q.options()) : at::Tensor();
  at::Tensor dv = need[2] ? at::empty({B, Hkv, S, D}, q.options()) : at::Tensor();
  const Strides qs(q), ks(k), vs(v), os(out), gs(gout);
  // dq `[b, h, s, d]`, dk and dv `[b, kv, s, d]`, contiguous
  const int64_t dq_b = H * S * D, dkv_b = Hkv * S * D, dh = S * D, drow_s = D;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>(), *gp = gout.data_ptr<float>();
  float* dqp = need[0] ? dq.data_ptr<float>() : nullptr;
  float* dkp = need[1] ? dk.data_ptr<float>() : nullptr;
  float* dvp = need[2] ? dv.data_ptr<float>() : nullptr;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor work = at::empty({2 * D * Sp + 2 * Sp * Sp + S}, q.options());
    float* kt = work.data_ptr<float>();
    float* vt = kt + D * Sp;
    float* p = vt + D * Sp;
    float* ds = p + Sp * Sp;
    float* drow = ds + Sp * Sp;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / Hkv, g = t % Hkv;
      const float* K = kp + ks.at(bi, g);
      const float* V = vp + vs.at(bi, g);
      float* dK = need[1] ? dkp + bi * dkv_b + g * dh : nullptr;
      float* dV = need[2] ? dvp + bi * dkv_b + g * dh : nullptr;
      transpose_rows(K, ks.s, S, D, Sp, kt);
      if (need_ds) {
        transpose_rows(V, vs.s, S, D, Sp, vt);
      }
      for (int64_t hh = 0; hh < rep; ++hh) {
        const int64_t h = g * rep + hh;
        const float* Q = qp + qs.at(bi, h);
        const float* O = op + os.at(bi, h);
        const float* G = gp + gs.at(bi, h);
        const float* L = lp + (bi * H + h) * S;
        float* dQ = need[0] ? dqp + bi * dq_b + h * dh : nullptr;
        for (int64_t i = 0; need_ds && i < S; ++i) {
          float acc = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            acc += G[i * gs.s + d] * O[i * os.s + d];
          }
          drow[i] = acc;
        }
        for (int64_t m0 = 0; m0 < S; m0 += 6) {
          const int64_t mr = std::min<int64_t>(6, S - m0), nk = m0 + mr;
          tiled_product(mr, nk, D, KRange::All, Q + m0 * qs.s, qs.s, 1, kt, Sp, p + m0 * Sp, Sp, false, scale);
          if (need_ds) {
            tiled_product(mr, nk, D, KRange::All, G + m0 * gs.s, gs.s, 1, vt, Sp, ds + m0 * Sp, Sp, false, 1.0f);
          }
          for (int64_t i = m0; i < nk; ++i) {
            float* pr = p + i * Sp;
            exp_shifted(pr, i + 1, L[i]);
            std::fill(pr + i + 1, pr + Sp, 0.0f);
            if (need_ds) {
              float* dr = ds + i * Sp;
              const float di = drow[i];
              for (int64_t j = 0; j <= i; ++j) {
                dr[j] = pr[j] * (dr[j] - di) * scale;
              }
              std::fill(dr + i + 1, dr + Sp, 0.0f);
            }
          }
        }
        if (need[0]) {
          tiled_product(S, D, Sp, KRange::UpToRow, ds, Sp, 1, K, ks.s, dQ, drow_s, false, 1.0f);
        }
        if (need[2]) {
          tiled_product(S, D, S, KRange::FromRow, p, 1, Sp, G, gs.s, dV, drow_s, hh > 0, 1.0f);
        }
        if (need[1]) {
          tiled_product(S, D, S, KRange::FromRow, ds, 1, Sp, Q, qs.s, dK, drow_s, hh > 0, 1.0f);
        }
      }
    }
  });
  return {dq, dk, dv};
}

#endif  // LSDK_CPU_GEMM

// A 4-d f32 CPU tensor whose last dim is contiguous (a copy otherwise).
at::Tensor rows_contiguous(const at::Tensor& t) {
  return t.stride(3) == 1 ? t : t.contiguous();
}

struct CausalAttentionBackward final : torch::autograd::Node {
  std::mutex mu;
  // detached aliases (sharing the version counters of what they alias) and their versions
  // when saved
  at::Tensor q, k, v, out, lse;
  std::array<uint32_t, 4> versions{};
  float scale = 1.0f;

  explicit CausalAttentionBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "CausalAttentionBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor sq, sk, sv, so, sl;
    {
      std::lock_guard<std::mutex> lock(mu);
      sq = q;
      sk = k;
      sv = v;
      so = out;
      sl = lse;
    }
    torch::autograd::variable_list res(3);
    if (grads.empty() || !grads[0].defined()) {
      return res;
    }
    TORCH_CHECK(sq.defined(), "the causal attention backward already ran (retain_graph)");
    TORCH_CHECK(
        !at::GradMode::is_enabled(),
        "the causal attention has no double backward (create_graph): use SDPA for that");
    const char* names[4] = {"q", "k", "v", "the output"};
    const at::Tensor* saved[4] = {&sq, &sk, &sv, &so};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(
          saved[i]->_version() == versions[i], "the causal attention's ", names[i],
          " was changed in place after the forward pass (version ", saved[i]->_version(),
          ", saved at ", versions[i], "): its gradients would be wrong");
    }
    at::NoGradGuard no_grad;
    RECORD_FUNCTION("lsdk::causal_attention_backward", std::vector<c10::IValue>({grads[0]}));
#ifdef LSDK_CPU_GEMM
    at::Tensor g = grads[0];
    if (g.scalar_type() != at::kFloat) {
      g = g.to(at::kFloat);
    }
    const std::array<bool, 3> need = {
        task_should_compute_output(0), task_should_compute_output(1), task_should_compute_output(2)};
    if (!need[0] && !need[1] && !need[2]) {
      return res;
    }
    auto [dq, dk, dv] = backward_values(sq, sk, sv, so, sl, rows_contiguous(g.transpose(1, 2)), scale, need);
    res[0] = dq;
    res[1] = dk;
    res[2] = dv;
#else
    TORCH_CHECK(false, "this build has no causal attention kernel");
#endif
    return res;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    q.reset();
    k.reset();
    v.reset();
    out.reset();
    lse.reset();
  }
};

std::string describe(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + t.device().str() + " " +
      c10::str(t.sizes());
}

at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale) {
  TORCH_CHECK(kernel_available(), "this CPU has no AVX2/FMA causal attention kernel");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in}) {
    TORCH_CHECK(
        t->dim() == 4 && t->device().is_cpu() && t->scalar_type() == at::kFloat,
        "the causal attention takes f32 CPU tensors [batch, heads, seq, head_dim], got ", describe(*t));
  }
  const int64_t B = q_in.size(0), H = q_in.size(1), S = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(
      k_in.sizes() == v_in.sizes() && k_in.size(0) == B && k_in.size(2) == S && k_in.size(3) == D,
      "the causal attention needs keys and values [batch, kv_heads, seq, head_dim] matching q ",
      q_in.sizes(), ", got k ", k_in.sizes(), " and v ", v_in.sizes());
  const int64_t Hkv = k_in.size(1);
  TORCH_CHECK(
      Hkv > 0 && H >= Hkv && H % Hkv == 0, "query heads ", H, " are not a multiple of kv heads ", Hkv);
  TORCH_CHECK(S >= 1 && S <= kMaxSeq, "the causal attention takes 1 to ", kMaxSeq, " positions, got ", S);
  TORCH_CHECK(
      D >= 16 && D <= kMaxHeadDim && D % 16 == 0,
      "the causal attention takes a head_dim that is a multiple of 16 up to ", kMaxHeadDim, ", got ", D);
  RECORD_FUNCTION("lsdk::causal_attention", std::vector<c10::IValue>({q_in, k_in, v_in}));
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  at::Tensor out, lse;  // out `[b, s, h, d]`
#ifdef LSDK_CPU_GEMM
  {
    at::NoGradGuard no_grad;
    std::tie(out, lse) = forward_values(q.detach(), k.detach(), v.detach(), static_cast<float>(scale));
  }
#endif
  if (torch::autograd::compute_requires_grad(q_in, k_in, v_in)) {
    auto node = c10::make_intrusive<CausalAttentionBackward>(torch::autograd::collect_next_edges(q_in, k_in, v_in));
    node->q = q.detach();
    node->k = k.detach();
    node->v = v.detach();
    // a detached alias: the node keeps the output's values without a reference to itself
    node->out = out.detach().transpose(1, 2);
    node->lse = lse;
    node->scale = static_cast<float>(scale);
    torch::autograd::set_history(out, c10::intrusive_ptr<torch::autograd::Node>(node));
    node->versions = {node->q._version(), node->k._version(), node->v._version(), out._version()};
  }
  return out;
}

}  // namespace

extern "C" {

// Whether this build and CPU have the causal attention kernel (x86-64 with AVX2 and FMA), and
// whether the shim was built with OpenMP (without it libtorch's `at::parallel_for` runs the
// kernel's tasks on one thread).
char* lsdk_causal_attention_available(int32_t* ok, int32_t* parallel) {
  return lsdk::guarded([&] {
    TORCH_CHECK(ok != nullptr && parallel != nullptr, "null output");
    *ok = kernel_available() ? 1 : 0;
#ifdef _OPENMP
    *parallel = 1;
#else
    *parallel = 0;
#endif
  });
}

// `softmax(q·kᵀ·scale + causal mask)·v` for f32 CPU q `[b, h, s, d]`, k and v `[b, kv, s, d]`,
// returned `[b, s, h, d]`.
char* lsdk_causal_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, double scale, at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(q != nullptr && k != nullptr && v != nullptr && y != nullptr, "null tensor");
    *y = new at::Tensor(causal_attention(*q, *k, *v, scale));
  });
}

}  // extern "C"
