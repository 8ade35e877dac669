// Element-wise operators of the LLaMA-family decoder block, each one autograd op with its own
// backward instead of a chain of libtorch element-wise ops (each reading and writing the whole
// activation, each an autograd node):
//
// - SwiGLU `h = silu(gate) ⊙ up` (`lsdk_silu_mul`, or `lsdk_swiglu` over gate and up side by side
//   in one tensor, the output of a fused gate/up GEMM). The node saves gate and up only and
//   recomputes the sigmoid in the backward pass, where libtorch's `silu` then `mul` also keep
//   `silu(gate)`: one activation `[tokens, ff]` less per layer. On the CPU in f32 one loop each
//   way; anywhere else (bf16 included: a bf16 loop measured slower than libtorch's vectorized
//   ops) the same libtorch ops the composite runs (`silu`, `mul`, `silu_backward`), so the
//   composite's numbers bit for bit.
// - RoPE in HF's `rotate_half` layout, `y = x·cos + rotate_half(x)·sin` (`lsdk_rope`), CPU f32.
// - RMSNorm `y = w ⊙ (x · rsqrt(mean(x²) + ε))` (`lsdk_rms_norm`, HF `LlamaRMSNorm` for an f32
//   input), CPU f32; saves x and the per-row `rsqrt` (what the composite keeps).
//
// The backward passes compute without a graph: these ops have no second derivative (LoRA training
// takes none). The CPU loops are compiled for AVX-512, AVX2 and baseline x86-64 (`LSDK_CLONES`, guard.h) and
// threaded over rows with libtorch's intra-op pool. Their values equal the composite's up to
// rounding: the sigmoid's `exp` here is a polynomial within 2 ulp of the correctly rounded value
// (libtorch's vectorized `exp` is SLEEF's, within 1 ulp), and RMSNorm's sum of squares is taken in
// 16 partial sums (libtorch's reduction order is its own).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "cpu_math.h"
#include "guard.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

namespace {

using lsdk::exp_f32;

// Rows of at most this many elements per task of the intra-op pool (smaller tensors stay on the
// calling thread).
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width));
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

// libtorch's CPU `silu` (x / (1 + e^−x)) and the factor of its `silu_backward`
// (σ·(1 + x·(1 − σ)), σ = 1 / (1 + e^−x)), in f32.
inline float silu_f32(float x) {
  return x / (1.0f + exp_f32(-x));
}

// SwiGLU over one f32 row of `n` values, forward (`h = silu(g)·u`) or backward
// (`du = dh·silu(g)`, `dg = (dh·u)·σ·(1 + g·(1 − σ))`), each product in the order of libtorch's
// composite (`silu`, `mul`; `mul`, `silu_backward`).
LSDK_CLONES void silu_mul_row(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    h[i] = silu_f32(g[i]) * u[i];
  }
}

LSDK_CLONES void silu_mul_grad_row(
    const float* dh,
    const float* g,
    const float* u,
    float* dg,
    float* du,
    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + exp_f32(-g[i]));
    du[i] = dh[i] * (g[i] / (1.0f + exp_f32(-g[i])));
    dg[i] = (dh[i] * u[i]) * s * (1.0f + g[i] * (1.0f - s));
  }
}

// A 2-d row view `[rows, width]` with unit stride along the row: `t` flattened over its leading
// dims, made contiguous first when that is not a view.
struct Rows {
  at::Tensor t;  // keeps the storage alive
  void* data;
  int64_t rows;
  int64_t width;
  int64_t stride;  // elements
};

Rows rows_of(const at::Tensor& t) {
  at::Tensor v = t;
  const int64_t width = t.size(-1);
  if (v.stride(-1) != 1) {
    v = v.contiguous();
  }
  at::Tensor flat;
  if (v.dim() == 1) {
    flat = v.unsqueeze(0);
  } else {
    // a view when the leading dims collapse into one stride, else a contiguous copy
    std::vector<int64_t> shape{-1, width};
    flat = v.reshape(shape);
    if (flat.stride(-1) != 1) {
      flat = flat.contiguous();
    }
  }
  return Rows{flat, flat.data_ptr(), flat.size(0), width, flat.stride(0)};
}

bool cpu_f32(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat;
}

// Whether the f32 row loops take `t`: f32 on the CPU with at least one dim and one element (a 0-d
// or empty tensor takes libtorch's ops).
bool f32_rows(const at::Tensor& t) {
  return cpu_f32(t) && t.dim() >= 1 && t.numel() > 0;
}

// "f32 on cpu"-style names of a tensor's dtype and device, for errors.
std::string dtype_device(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " on " + t.device().str();
}

// out[r] = silu(g[r])·u[r] over rows (`out_stride` elements a row).
void silu_mul_rows(const Rows& g, const Rows& u, float* out, int64_t out_stride) {
  at::parallel_for(0, g.rows, grain_rows(g.width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      silu_mul_row(
          static_cast<const float*>(g.data) + r * g.stride,
          static_cast<const float*>(u.data) + r * u.stride,
          out + r * out_stride,
          g.width);
    }
  });
}

// The gradients into `dg` and `du` (`d_stride` elements a row).
void silu_mul_grad_rows(
    const Rows& dh,
    const Rows& g,
    const Rows& u,
    float* dg,
    float* du,
    int64_t d_stride) {
  at::parallel_for(0, g.rows, grain_rows(g.width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      silu_mul_grad_row(
          static_cast<const float*>(dh.data) + r * dh.stride,
          static_cast<const float*>(g.data) + r * g.stride,
          static_cast<const float*>(u.data) + r * u.stride,
          dg + r * d_stride,
          du + r * d_stride,
          g.width);
    }
  });
}

// Backward of SwiGLU. `joined`: the input was one tensor `[..., 2·ff]` (gate, then up) and the
// gradient is one tensor of that shape; else two inputs and two gradients.
struct SwiGluBackward final : torch::autograd::Node {
  std::mutex mu;
  at::Tensor gate;
  at::Tensor up;
  bool joined = false;
  std::vector<int64_t> joined_sizes;

  explicit SwiGluBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "SwiGluBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor g, u;
    {
      std::lock_guard<std::mutex> lock(mu);
      g = gate;
      u = up;
    }
    const size_t n_out = joined ? 1 : 2;
    torch::autograd::variable_list out(n_out);
    if (grads.empty() || !grads[0].defined()) {
      return out;
    }
    TORCH_CHECK(g.defined() && u.defined(), "the SwiGLU backward already ran (retain_graph)");
    at::NoGradGuard no_grad;
    RECORD_FUNCTION("lsdk::swiglu_backward", std::vector<c10::IValue>({grads[0], g, u}));
    const at::Tensor& dh = grads[0];
    at::Tensor dg, du;
    if (f32_rows(dh) && f32_rows(g) && f32_rows(u)) {
      const Rows dr = rows_of(dh), gr = rows_of(g), ur = rows_of(u);
      if (joined) {
        at::Tensor d = at::empty(joined_sizes, g.options());
        float* p = d.data_ptr<float>();
        silu_mul_grad_rows(dr, gr, ur, p, p + gr.width, 2 * gr.width);
        out[0] = d;
        return out;
      }
      // both gradients in one allocation, rows of one stride
      at::Tensor both = at::empty({2, gr.rows, gr.width}, g.options());
      float* p = both.data_ptr<float>();
      silu_mul_grad_rows(dr, gr, ur, p, p + gr.rows * gr.width, gr.width);
      dg = both.select(0, 0).view(g.sizes());
      du = both.select(0, 1).view(u.sizes());
    } else {
      // what autograd computes for `silu(g) * u`
      du = dh * at::silu(g);
      dg = at::silu_backward(dh * u, g);
    }
    if (joined) {
      out[0] = at::cat({dg, du}, -1);
    } else {
      out[0] = task_should_compute_output(0) ? dg : at::Tensor();
      out[1] = task_should_compute_output(1) ? du : at::Tensor();
    }
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    gate.reset();
    up.reset();
  }
};

// silu(g)·u without autograd: the CPU loop for f32, libtorch's ops elsewhere.
at::Tensor silu_mul_values(const at::Tensor& g, const at::Tensor& u) {
  at::NoGradGuard no_grad;
  if (f32_rows(g) && f32_rows(u)) {
    const Rows gr = rows_of(g), ur = rows_of(u);
    at::Tensor h = at::empty(g.sizes(), g.options());
    silu_mul_rows(gr, ur, h.data_ptr<float>(), gr.width);
    return h;
  }
  return at::silu(g) * u;
}

at::Tensor swiglu_impl(const at::Tensor* joined, const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(
      g.sizes() == u.sizes(), "SwiGLU: gate ", g.sizes(), " and up ", u.sizes(), " differ in shape");
  TORCH_CHECK(
      g.scalar_type() == u.scalar_type() && g.device() == u.device(),
      "SwiGLU: gate and up differ in dtype or device (", g.scalar_type(), " on ", g.device(),
      ", ", u.scalar_type(), " on ", u.device(), ")");
  TORCH_CHECK(at::isFloatingType(g.scalar_type()), "SwiGLU takes floating tensors, got ", g.scalar_type());
  RECORD_FUNCTION("lsdk::swiglu", std::vector<c10::IValue>({g, u}));
  at::Tensor h = silu_mul_values(g, u);
  const bool grad = joined != nullptr ? torch::autograd::compute_requires_grad(*joined)
                                      : torch::autograd::compute_requires_grad(g, u);
  if (grad) {
    auto node = c10::make_intrusive<SwiGluBackward>(
        joined != nullptr ? torch::autograd::collect_next_edges(*joined)
                          : torch::autograd::collect_next_edges(g, u));
    node->gate = g;
    node->up = u;
    if (joined != nullptr) {
      node->joined = true;
      node->joined_sizes = joined->sizes().vec();
    }
    torch::autograd::set_history(h, c10::intrusive_ptr<torch::autograd::Node>(std::move(node)));
  }
  return h;
}

// ---------------------------------------------------------------------------------------------
// RoPE

// One row of `d` values: y = x·c + rotate_half(x)·s, rotate_half([x1, x2]) = [−x2, x1]; with
// `backward` the transpose, y = x·c + [x2·s2, −x1·s1] (x being the incoming gradient).
LSDK_CLONES void rope_row(
    const float* x,
    const float* c,
    const float* s,
    float* y,
    int64_t d,
    bool backward) {
  const int64_t half = d / 2;
  if (!backward) {
    for (int64_t i = 0; i < half; ++i) {
      y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    }
    for (int64_t i = half; i < d; ++i) {
      y[i] = x[i] * c[i] + x[i - half] * s[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      y[i] = x[i] * c[i] + x[i + half] * s[i + half];
    }
    for (int64_t i = half; i < d; ++i) {
      y[i] = x[i] * c[i] + (-x[i - half]) * s[i - half];
    }
  }
}

// `t` broadcast to `sizes` (4-d) with unit stride on the last dim.
at::Tensor rope_operand(const at::Tensor& t, at::IntArrayRef sizes) {
  at::Tensor e = t.expand(sizes);
  if (e.stride(3) != 1) {
    e = t.contiguous().expand(sizes);
  }
  return e;
}

// y = rope(x) (or its transpose) over every row of a 4-d `x` `[b, h, s, d]`; `y` is allocated
// with x's strides when they are dense (the layout the composite's output would have).
at::Tensor rope_values(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const auto sizes = x.sizes();
  const at::Tensor c = rope_operand(cos, sizes), s = rope_operand(sin, sizes);
  at::Tensor y = at::empty_like(x);
  if (y.stride(3) != 1) {
    y = at::empty(sizes, x.options());
  }
  const int64_t B = sizes[0], H = sizes[1], S = sizes[2], D = sizes[3];
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto xs = x.strides(), cs = c.strides(), ss = s.strides(), ys = y.strides();
  at::parallel_for(0, B * H * S, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * S), h = (r / S) % H, t = r % S;
      rope_row(
          xp + b * xs[0] + h * xs[1] + t * xs[2],
          cp + b * cs[0] + h * cs[1] + t * cs[2],
          sp + b * ss[0] + h * ss[1] + t * ss[2],
          yp + b * ys[0] + h * ys[1] + t * ys[2],
          D,
          backward);
    }
  });
  return y;
}

struct RopeBackward final : torch::autograd::Node {
  std::mutex mu;
  at::Tensor cos;
  at::Tensor sin;

  explicit RopeBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "RopeBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor c, s;
    {
      std::lock_guard<std::mutex> lock(mu);
      c = cos;
      s = sin;
    }
    torch::autograd::variable_list out(1);
    if (grads.empty() || !grads[0].defined()) {
      return out;
    }
    TORCH_CHECK(c.defined() && s.defined(), "the RoPE backward already ran (retain_graph)");
    at::NoGradGuard no_grad;
    RECORD_FUNCTION("lsdk::rope_backward", std::vector<c10::IValue>({grads[0]}));
    at::Tensor g = grads[0];
    if (g.scalar_type() != at::kFloat) {
      g = g.to(at::kFloat);
    }
    out[0] = rope_values(g, c, s, true);
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    cos.reset();
    sin.reset();
  }
};

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "RoPE takes x [batch, heads, seq, head_dim], got ", x.sizes());
  TORCH_CHECK(x.size(3) % 2 == 0, "RoPE needs an even head_dim, got ", x.size(3));
  TORCH_CHECK(
      cpu_f32(x) && cpu_f32(cos) && cpu_f32(sin), "the fused RoPE takes f32 CPU tensors, got x ",
      dtype_device(x), ", cos ", dtype_device(cos), ", sin ", dtype_device(sin));
  TORCH_CHECK(
      cos.dim() == 4 && sin.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(3) == x.size(3),
      "RoPE tables ", cos.sizes(), " and ", sin.sizes(), " do not fit x ", x.sizes());
  for (int64_t i = 0; i < 3; ++i) {
    TORCH_CHECK(
        cos.size(i) == 1 || cos.size(i) == x.size(i), "RoPE tables ", cos.sizes(), " do not broadcast to x ", x.sizes());
  }
  TORCH_CHECK(
      !torch::autograd::compute_requires_grad(cos, sin),
      "the fused RoPE takes constant cos/sin tables (no gradient)");
  RECORD_FUNCTION("lsdk::rope", std::vector<c10::IValue>({x, cos, sin}));
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = rope_values(x, cos, sin, false);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = c10::make_intrusive<RopeBackward>(torch::autograd::collect_next_edges(x));
    node->cos = cos;
    node->sin = sin;
    torch::autograd::set_history(y, c10::intrusive_ptr<torch::autograd::Node>(std::move(node)));
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// Σ x² of one row in 16 partial sums (vectorizes without reassociating the loop).
LSDK_CLONES float sum_squares(const float* x, int64_t n) {
  float acc[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) {
      acc[k] += x[i + k] * x[i + k];
    }
  }
  float s = 0.0f;
  for (int k = 0; k < 16; ++k) {
    s += acc[k];
  }
  for (; i < n; ++i) {
    s += x[i] * x[i];
  }
  return s;
}

// Σ g·w·x of one row in 16 partial sums.
LSDK_CLONES float dot3(const float* g, const float* w, const float* x, int64_t n) {
  float acc[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) {
      acc[k] += (g[i + k] * w[i + k]) * x[i + k];
    }
  }
  float s = 0.0f;
  for (int k = 0; k < 16; ++k) {
    s += acc[k];
  }
  for (; i < n; ++i) {
    s += (g[i] * w[i]) * x[i];
  }
  return s;
}

LSDK_CLONES void rms_norm_row(const float* x, const float* w, float rstd, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] = w[i] * (x[i] * rstd);
  }
}

// dx = (g·w)·rstd − x·c with c = rstd³·Σ(g·w·x)/n.
LSDK_CLONES void rms_norm_grad_row(
    const float* g,
    const float* w,
    const float* x,
    float rstd,
    float c,
    float* dx,
    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = (g[i] * w[i]) * rstd - x[i] * c;
  }
}

struct RmsNormBackward final : torch::autograd::Node {
  std::mutex mu;
  at::Tensor x;     // [rows, n] contiguous
  at::Tensor w;     // [n]
  at::Tensor rstd;  // [rows]
  std::vector<int64_t> x_sizes;

  explicit RmsNormBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "RmsNormBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor xs, ws, rs;
    {
      std::lock_guard<std::mutex> lock(mu);
      xs = x;
      ws = w;
      rs = rstd;
    }
    torch::autograd::variable_list out(2);
    if (grads.empty() || !grads[0].defined()) {
      return out;
    }
    TORCH_CHECK(xs.defined(), "the RMSNorm backward already ran (retain_graph)");
    at::NoGradGuard no_grad;
    RECORD_FUNCTION("lsdk::rms_norm_backward", std::vector<c10::IValue>({grads[0]}));
    const int64_t n = xs.size(1), rows = xs.size(0);
    at::Tensor g = grads[0].to(at::kFloat).reshape({rows, n}).contiguous();
    if (task_should_compute_output(0)) {
      at::Tensor dx = at::empty({rows, n}, xs.options());
      const float* gp = g.data_ptr<float>();
      const float* wp = ws.data_ptr<float>();
      const float* xp = xs.data_ptr<float>();
      const float* rp = rs.data_ptr<float>();
      float* dp = dx.data_ptr<float>();
      at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float rstd = rp[r];
          const float dot = dot3(gp + r * n, wp, xp + r * n, n);
          const float c = rstd * rstd * rstd * dot / static_cast<float>(n);
          rms_norm_grad_row(gp + r * n, wp, xp + r * n, rstd, c, dp + r * n, n);
        }
      });
      out[0] = dx.view(x_sizes);
    }
    if (task_should_compute_output(1)) {
      // a trained norm weight (modules_to_save): Σ over rows of g·x̂
      out[1] = (g * (xs * rs.unsqueeze(1))).sum(0);
    }
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    x.reset();
    w.reset();
    rstd.reset();
  }
};

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(
      cpu_f32(x_in) && cpu_f32(w_in), "the fused RMSNorm takes f32 CPU tensors, got x ",
      dtype_device(x_in), " and weight ", dtype_device(w_in));
  TORCH_CHECK(
      w_in.dim() == 1 && x_in.dim() >= 1 && x_in.size(-1) == w_in.size(0),
      "RMSNorm weight ", w_in.sizes(), " does not fit x ", x_in.sizes());
  RECORD_FUNCTION("lsdk::rms_norm", std::vector<c10::IValue>({x_in, w_in}));
  if (x_in.numel() == 0) {
    // nothing to normalize: libtorch's ops keep the shape and the graph
    return w_in * (x_in * at::rsqrt(x_in.pow(2).mean(-1, true) + eps));
  }
  const int64_t n = x_in.size(-1);
  at::Tensor x, w, y, rstd;
  {
    at::NoGradGuard no_grad;
    x = x_in.reshape({-1, n}).contiguous();
    w = w_in.contiguous();
    const int64_t rows = x.size(0);
    y = at::empty({rows, n}, x.options());
    rstd = at::empty({rows}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float mean = sum_squares(xp + r * n, n) / static_cast<float>(n);
        const float rs = 1.0f / std::sqrt(mean + e);
        rp[r] = rs;
        rms_norm_row(xp + r * n, wp, rs, yp + r * n, n);
      }
    });
    y = y.view(x_in.sizes());
  }
  if (torch::autograd::compute_requires_grad(x_in, w_in)) {
    auto node = c10::make_intrusive<RmsNormBackward>(torch::autograd::collect_next_edges(x_in, w_in));
    node->x = x;
    node->w = w;
    node->rstd = rstd;
    node->x_sizes = x_in.sizes().vec();
    torch::autograd::set_history(y, c10::intrusive_ptr<torch::autograd::Node>(std::move(node)));
  }
  return y;
}

}  // namespace

extern "C" {

// `silu(g) ⊙ u` (same shapes, dtype and device) → a new tensor; an autograd op (see the top of
// this file).
char* lsdk_silu_mul(const at::Tensor* g, const at::Tensor* u, at::Tensor** h) {
  return lsdk::guarded([&] {
    TORCH_CHECK(g != nullptr && u != nullptr && h != nullptr, "null tensor");
    *h = new at::Tensor(swiglu_impl(nullptr, *g, *u));
  });
}

// `silu(gate) ⊙ up` of `gu` `[..., 2·ff]` (gate the first half of the last dim, up the second)
// → `[..., ff]`; the gradient flows back as one tensor shaped like `gu`.
char* lsdk_swiglu(const at::Tensor* gu, at::Tensor** h) {
  return lsdk::guarded([&] {
    TORCH_CHECK(gu != nullptr && h != nullptr, "null tensor");
    TORCH_CHECK(gu->dim() >= 1 && gu->size(-1) % 2 == 0, "SwiGLU needs an even last dim, got ", gu->sizes());
    const int64_t ff = gu->size(-1) / 2;
    at::Tensor g, u;
    {
      at::NoGradGuard no_grad;
      g = gu->narrow(-1, 0, ff);
      u = gu->narrow(-1, ff, ff);
    }
    *h = new at::Tensor(swiglu_impl(gu, g, u));
  });
}

// `x·cos + rotate_half(x)·sin` for f32 CPU `x` `[b, h, s, d]` and tables broadcasting to it.
char* lsdk_rope(const at::Tensor* x, const at::Tensor* cos, const at::Tensor* sin, at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(x != nullptr && cos != nullptr && sin != nullptr && y != nullptr, "null tensor");
    *y = new at::Tensor(rope(*x, *cos, *sin));
  });
}

// RMSNorm of f32 CPU `x` `[..., n]` with weight `[n]`.
char* lsdk_rms_norm(const at::Tensor* x, const at::Tensor* w, double eps, at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(x != nullptr && w != nullptr && y != nullptr, "null tensor");
    *y = new at::Tensor(rms_norm(*x, *w, eps));
  });
}

}  // extern "C"
