// The LoRA branches of one or more sibling linears that read the same input, added to their
// frozen products, as one f32 autograd op for x86-64 CPUs with AVX2 and FMA:
//
//   y[:, seg_i] = base[:, seg_i] + s_i · (x·A_iᵀ)·B_iᵀ        (PEFT's `base(x) + B(A(x))·scaling`)
//
// x `[n, in]`, base and y `[n, Σ out_i]` (site i's outputs the columns seg_i, in order), A_i
// `[r_i, in]`, B_i `[out_i, r_i]`, s_i the site's scaling. Backward, with g = ∂y and
// h = x·Aᵀ (`[n, Σ r_i]`, the sites' ranks side by side, saved unscaled):
//
//   ∂base = g,   gh_i = s_i · g[:, seg_i]·B_i,   ∂B_i = s_i · g[:, seg_i]ᵀ·h_i,
//   ∂A = ghᵀ·x,  ∂x = gh·A                        (A = [A_1; …; A_n], gh = [gh_1, …, gh_n]).
//
// At rank 8 and a few hundred tokens these products are skinny (one side 8 to 32 wide), where
// MKL's sgemm ran at 12–16 GFLOP/s for some of them on a 2-core AVX2 EPYC (`[256, 576]·[576, 8]`
// 0.15 ms); each here is one pass of the register tiles of `cpu_gemm.h` (6 × 16, or 12 × 8 for
// results at most 8 wide) over strided operands, in parallel over libtorch's intra-op threads. The
// sites' B factors are not joined into a block-diagonal matrix (which multiplies zeros): each is
// its own product. Long sums are added up in runs of 64 (`cpu_gemm.h`), which keeps the values as
// close to the f64 ones as libtorch's own f32 products. Saved for the backward pass: x (which the
// frozen product saves as well), h, and aliases of the factors; the node refuses to run after x or
// a factor was changed in place, and has no double backward.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "cpu_gemm.h"
#include "guard.h"

#include <mutex>
#include <string>
#include <vector>

namespace {

std::string describe(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + t.device().str() + " " +
      c10::str(t.sizes());
}

// A 2-d `[rows, cols]` view of `t` `[..., cols]` whose rows are contiguous (a copy otherwise).
at::Tensor rows_2d(const at::Tensor& t, int64_t cols) {
  at::Tensor v = t.reshape({-1, cols});
  return v.stride(1) == 1 ? v : v.contiguous();
}

struct Sites {
  std::vector<int64_t> rank, rank_off, out, out_off;
  int64_t ranks = 0, outs = 0;
};

Sites sites_of(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  Sites s;
  for (size_t i = 0; i < a.size(); ++i) {
    s.rank.push_back(a[i].size(0));
    s.rank_off.push_back(s.ranks);
    s.ranks += a[i].size(0);
    s.out.push_back(b[i].size(0));
    s.out_off.push_back(s.outs);
    s.outs += b[i].size(0);
  }
  return s;
}

#ifdef LSDK_CPU_GEMM

// A per-thread buffer of at least `n` floats for a packed copy of the factors, kept between
// calls for the thread's life (`slot` 0 or 1 tells apart buffers live at the same time): `[in, R]`
// and `[R, in]` (A), `[r_i, out_i]` and `[out_i, r_i]` (B), whose size does not grow with the
// tokens — 55 KiB for SmolLM2's q/k/v at rank 8, 3 MiB for a 12,288-wide B at rank 64 — held
// outside libtorch's allocator. Products that grow with the tokens (h, gh, y, ∂x) are tensors.
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& v = buffers[slot];
  if (static_cast<int64_t>(v.size()) < n) {
    v.resize(static_cast<size_t>(n));
  }
  return v.data();
}

// dst[i·ld + j] = t[i, j] (or t[j, i] with `transpose`) for the 2-d f32 `t` read through its
// strides: `rows` × `cols` values, `rows` = t.size(0) (t.size(1) transposed).
void pack(const at::Tensor& t, bool transpose, float* dst, int64_t ld) {
  const float* p = t.data_ptr<float>();
  const int64_t s0 = transpose ? t.stride(1) : t.stride(0), s1 = transpose ? t.stride(0) : t.stride(1);
  const int64_t rows = transpose ? t.size(1) : t.size(0), cols = transpose ? t.size(0) : t.size(1);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      dst[i * ld + j] = p[i * s0 + j * s1];
    }
  }
}

// h `[n, R]` = x·Aᵀ (x `[n, in]` with contiguous rows).
at::Tensor rank_products(const at::Tensor& x, const std::vector<at::Tensor>& a, const Sites& s) {
  const int64_t n = x.size(0), in = x.size(1);
  // Aᵀ `[in, R]`, the sites' factors side by side: the tiles read up to 16 of its columns a step
  float* at_ = scratch(0, in * s.ranks);
  for (size_t i = 0; i < a.size(); ++i) {
    pack(a[i], true, at_ + s.rank_off[i], s.ranks);
  }
  at::Tensor h = at::empty({n, s.ranks}, x.options());
  lsdk::strided_product(
      n, s.ranks, in, x.data_ptr<float>(), x.stride(0), 1, at_, s.ranks, h.data_ptr<float>(),
      s.ranks, nullptr, 0, 1.0f, true);
  return h;
}

// y, shaped `y_sizes` (the frozen products' sizes: the output is no view, so that it can be
// changed in place like any op's), from base `[n, Σ out_i]` and h.
at::Tensor forward_values(
    const at::Tensor& x,
    const at::Tensor& base,
    const at::Tensor& h,
    const std::vector<at::Tensor>& b,
    const std::vector<double>& scales,
    const Sites& s,
    at::IntArrayRef y_sizes) {
  const int64_t n = x.size(0);
  at::Tensor y = at::empty(y_sizes, x.options());
  for (size_t i = 0; i < b.size(); ++i) {
    // B_iᵀ `[r_i, out_i]`
    float* bt = scratch(1, s.rank[i] * s.out[i]);
    pack(b[i], true, bt, s.out[i]);
    lsdk::strided_product(
        n, s.out[i], s.rank[i], h.data_ptr<float>() + s.rank_off[i], s.ranks, 1, bt, s.out[i],
        y.data_ptr<float>() + s.out_off[i], s.outs, base.data_ptr<float>() + s.out_off[i],
        base.stride(0), static_cast<float>(scales[i]), true);
  }
  return y;
}

#endif  // LSDK_CPU_GEMM

struct LoraBranchBackward final : torch::autograd::Node {
  std::mutex mu;
  // detached aliases (sharing the version counters of what they alias) and their versions
  at::Tensor x, h;
  std::vector<at::Tensor> a, b;
  std::vector<uint32_t> versions;  // x, then A_1 … A_n, then B_1 … B_n
  std::vector<double> scales;
  std::vector<int64_t> x_sizes, base_sizes;

  explicit LoraBranchBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "LoraBranchBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor sx, sh;
    std::vector<at::Tensor> sa, sb;
    {
      std::lock_guard<std::mutex> lock(mu);
      sx = x;
      sh = h;
      sa = a;
      sb = b;
    }
    const size_t ns = sa.size();
    torch::autograd::variable_list res(2 + 2 * ns);
    if (grads.empty() || !grads[0].defined()) {
      return res;
    }
    TORCH_CHECK(sx.defined(), "the LoRA branch's backward already ran (retain_graph)");
    TORCH_CHECK(
        !at::GradMode::is_enabled(),
        "the LoRA branch op has no double backward (create_graph): turn the kernel off with "
        "LORA_CPU_LORA=libtorch");
    for (size_t i = 0; i < 1 + 2 * ns; ++i) {
      const at::Tensor& t = i == 0 ? sx : (i <= ns ? sa[i - 1] : sb[i - 1 - ns]);
      TORCH_CHECK(
          t._version() == versions[i], "the LoRA branch's ",
          i == 0 ? std::string("input") : (i <= ns ? "A factor " : "B factor ") + std::to_string((i - 1) % ns),
          " was changed in place after the forward pass (version ", t._version(), ", saved at ",
          versions[i], "): its gradients would be wrong");
    }
    at::NoGradGuard no_grad;
    RECORD_FUNCTION("lsdk::lora_branch_backward", std::vector<c10::IValue>({grads[0]}));
    const Sites s = sites_of(sa, sb);
    at::Tensor g = grads[0];
    if (g.scalar_type() != at::kFloat) {
      g = g.to(at::kFloat);
    }
    if (task_should_compute_output(1)) {
      res[1] = g.reshape(base_sizes);
    }
#ifdef LSDK_CPU_GEMM
    g = rows_2d(g, s.outs);
    const int64_t n = sx.size(0), in = sx.size(1);
    const float* gp = g.data_ptr<float>();
    const int64_t gs = g.stride(0);
    bool need_a = false;
    for (size_t i = 0; i < ns; ++i) {
      need_a = need_a || task_should_compute_output(2 + i);
    }
    const bool need_x = task_should_compute_output(0);
    if (need_a || need_x) {
      // gh `[n, R]`, gh_i = s_i · g_i·B_i (B_i `[out_i, r_i]` row-major)
      at::Tensor gh_t = at::empty({n, s.ranks}, sx.options());
      float* gh = gh_t.data_ptr<float>();
      for (size_t i = 0; i < ns; ++i) {
        const float* bi = sb[i].data_ptr<float>();
        if (!sb[i].is_contiguous()) {
          float* packed = scratch(1, s.out[i] * s.rank[i]);
          pack(sb[i], false, packed, s.rank[i]);
          bi = packed;
        }
        lsdk::strided_product(
            n, s.rank[i], s.out[i], gp + s.out_off[i], gs, 1, bi, s.rank[i], gh + s.rank_off[i],
            s.ranks, nullptr, 0, static_cast<float>(scales[i]), true);
      }
      if (need_a) {
        // ∂A `[R, in]` = ghᵀ·x; each site's rows a contiguous slice
        at::Tensor ga = at::empty({s.ranks, in}, sx.options());
        lsdk::strided_product(
            s.ranks, in, n, gh, 1, s.ranks, sx.data_ptr<float>(), sx.stride(0),
            ga.data_ptr<float>(), in, nullptr, 0, 1.0f, true);
        for (size_t i = 0; i < ns; ++i) {
          if (task_should_compute_output(2 + i)) {
            res[2 + i] = ga.narrow(0, s.rank_off[i], s.rank[i]);
          }
        }
      }
      if (need_x) {
        // ∂x `[n, in]` = gh·A, A the factors stacked `[R, in]`
        float* acat = scratch(1, s.ranks * in);
        for (size_t i = 0; i < ns; ++i) {
          pack(sa[i], false, acat + s.rank_off[i] * in, in);
        }
        at::Tensor gx = at::empty({n, in}, sx.options());
        lsdk::strided_product(
            n, in, s.ranks, gh, s.ranks, 1, acat, in, gx.data_ptr<float>(), in, nullptr, 0, 1.0f,
            true);
        res[0] = gx.view(x_sizes);
      }
    }
    for (size_t i = 0; i < ns; ++i) {
      if (!task_should_compute_output(2 + ns + i)) {
        continue;
      }
      // ∂B_i `[out_i, r_i]` = s_i · g_iᵀ·h_i (12 × 8 tiles at rank 8)
      const int64_t r = s.rank[i], o = s.out[i];
      at::Tensor gb = at::empty({o, r}, sx.options());
      lsdk::strided_product(
          o, r, n, gp + s.out_off[i], 1, gs, sh.data_ptr<float>() + s.rank_off[i], s.ranks,
          gb.data_ptr<float>(), r, nullptr, 0, static_cast<float>(scales[i]), true);
      res[2 + ns + i] = gb;
    }
#else
    TORCH_CHECK(false, "this build has no LoRA branch kernel");
#endif
    return res;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    x.reset();
    h.reset();
    a.clear();
    b.clear();
  }
};

at::Tensor lora_branch(
    const at::Tensor& x_in,
    const at::Tensor& base_in,
    const std::vector<at::Tensor>& a_in,
    const std::vector<at::Tensor>& b_in,
    const std::vector<double>& scales) {
  TORCH_CHECK(lsdk::cpu_gemm_available(), "this CPU has no AVX2/FMA for the LoRA branch kernel");
  TORCH_CHECK(
      !a_in.empty() && a_in.size() == b_in.size() && a_in.size() == scales.size(),
      "the LoRA branch takes as many A factors, B factors and scalings (at least one), got ",
      a_in.size(), ", ", b_in.size(), " and ", scales.size());
  auto f32_cpu = [](const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat;
  };
  TORCH_CHECK(
      f32_cpu(x_in) && x_in.dim() >= 1, "the LoRA branch takes an f32 CPU input [..., in], got ",
      x_in.defined() ? describe(x_in) : "an undefined tensor");
  TORCH_CHECK(
      f32_cpu(base_in) && base_in.dim() == x_in.dim(),
      "the LoRA branch takes f32 CPU frozen products with the input's leading dims, got ",
      base_in.defined() ? describe(base_in) : "an undefined tensor", " for input ", describe(x_in));
  const int64_t in = x_in.size(-1);
  int64_t outs = 0;
  for (size_t i = 0; i < a_in.size(); ++i) {
    const at::Tensor &a = a_in[i], &b = b_in[i];
    TORCH_CHECK(
        f32_cpu(a) && f32_cpu(b) && a.dim() == 2 && b.dim() == 2 && a.size(1) == in &&
            b.size(1) == a.size(0) && a.size(0) > 0,
        "LoRA site ", i, ": A must be f32 CPU [r, ", in, "] and B [out, r] with r ≥ 1, got A ",
        describe(a), " and B ", describe(b));
    outs += b.size(0);
  }
  for (int64_t d = 0; d + 1 < x_in.dim(); ++d) {
    TORCH_CHECK(
        base_in.size(d) == x_in.size(d), "the frozen products ", base_in.sizes(),
        " do not have the input's leading dims ", x_in.sizes());
  }
  TORCH_CHECK(
      base_in.size(-1) == outs, "the frozen products have ", base_in.size(-1),
      " columns, the sites' B factors ", outs, " rows");
  RECORD_FUNCTION("lsdk::lora_branch", std::vector<c10::IValue>({x_in, base_in}));
  std::vector<at::Tensor> a, b;
  for (size_t i = 0; i < a_in.size(); ++i) {
    a.push_back(a_in[i].detach());
    b.push_back(b_in[i].detach());
  }
  const Sites s = sites_of(a, b);
  const at::Tensor x = rows_2d(x_in.detach(), in);
  at::Tensor h, y;
#ifdef LSDK_CPU_GEMM
  {
    at::NoGradGuard no_grad;
    h = rank_products(x, a, s);
    y = forward_values(x, rows_2d(base_in.detach(), outs), h, b, scales, s, base_in.sizes());
  }
#endif
  std::vector<int64_t> y_sizes = base_in.sizes().vec();
  std::vector<at::Tensor> inputs = {x_in, base_in};
  inputs.insert(inputs.end(), a_in.begin(), a_in.end());
  inputs.insert(inputs.end(), b_in.begin(), b_in.end());
  if (torch::autograd::compute_requires_grad(inputs)) {
    auto node = c10::make_intrusive<LoraBranchBackward>(torch::autograd::collect_next_edges(inputs));
    node->x = x;
    node->h = h;
    node->scales = scales;
    node->x_sizes = x_in.sizes().vec();
    node->base_sizes = y_sizes;
    node->versions.push_back(x._version());
    for (size_t i = 0; i < a_in.size(); ++i) {
      // aliases of the parameters themselves (a copy would hide an in-place change)
      node->a.push_back(a_in[i].detach());
      node->versions.push_back(a_in[i]._version());
    }
    for (size_t i = 0; i < b_in.size(); ++i) {
      node->b.push_back(b_in[i].detach());
      node->versions.push_back(b_in[i]._version());
    }
    torch::autograd::set_history(y, c10::intrusive_ptr<torch::autograd::Node>(node));
  }
  return y;
}

}  // namespace

extern "C" {

// `base + Σ_i s_i·(x·A_iᵀ)·B_iᵀ` over the sites' column ranges (see the top of this file):
// `n` sites, `a` and `b` arrays of `n` tensors, `scales` `n` values.
char* lsdk_lora_branch(
    const at::Tensor* x,
    const at::Tensor* base,
    const at::Tensor* const* a,
    const at::Tensor* const* b,
    const double* scales,
    int64_t n,
    at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(x != nullptr && base != nullptr && y != nullptr && n >= 0, "null tensor");
    TORCH_CHECK(n == 0 || (a != nullptr && b != nullptr && scales != nullptr), "null factor list");
    std::vector<at::Tensor> av, bv;
    std::vector<double> sv;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(a[i] != nullptr && b[i] != nullptr, "null factor ", i);
      av.push_back(*a[i]);
      bv.push_back(*b[i]);
      sv.push_back(scales[i]);
    }
    *y = new at::Tensor(lora_branch(*x, *base, av, bv, sv));
  });
}

}  // extern "C"
