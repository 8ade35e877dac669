// `y = x · Wᵀ` with bf16 autocast's numerics computed by f32 GEMMs, for CPUs whose libtorch has
// no fast bf16 GEMM. libtorch multiplies bf16 on the CPU through oneDNN only where
// `mkldnn_bf16_device_check()` holds (AVX-512 BW/VL/DQ, or Arm bf16;
// aten/src/ATen/native/mkldnn/Utils.h); elsewhere `cpublas::gemm` falls back to scalar loops
// (measured on an AVX2 machine: 16 GFLOP/s for `x · Wᵀ`, 1.7 GFLOP/s for `g · W`, against 70–110
// GFLOP/s in f32 on the same shapes).
//
// What autocast computes for a linear is: both operands rounded to bf16, products summed in f32,
// the result rounded to bf16; backward, the bf16 gradient times the saved bf16 operands, summed in
// f32 and rounded to bf16. Every bf16 value is exact in f32, so one f32 GEMM over the bf16
// operands widened, rounded to bf16, gives the same function up to the summation order. The node
// saves the bf16 operands (x's only when W takes a gradient, W's only when x does), as autocast's
// graph holds them, and widens them again in the backward pass.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "guard.h"

#include <memory>
#include <mutex>
#include <string>

namespace {

at::Tensor widen(const at::Tensor& t) {
  return t.to(at::kFloat);
}

// The backward of `y = round(round(x) · round(W)ᵀ)`: `∂x = round(g · Wb)`, `∂W = round(gᵀ · xb)`,
// each in its input's dtype (as autocast's cast nodes return them).
struct Bf16LinearBackward final : torch::autograd::Node {
  std::mutex mu;
  at::Tensor xb;  // [n, in] bf16, defined when W takes a gradient
  at::Tensor wb;  // [out, in] bf16, defined when x takes a gradient
  std::vector<int64_t> x_sizes;
  at::ScalarType x_type;
  at::ScalarType w_type;

  Bf16LinearBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "Bf16ViaF32LinearBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x_saved, w_saved;
    {
      std::lock_guard<std::mutex> lock(mu);
      x_saved = xb;
      w_saved = wb;
    }
    torch::autograd::variable_list out(2);
    if (grads.empty() || !grads[0].defined()) {
      return out;
    }
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::NoGradGuard no_grad;
    const int64_t n_out = grads[0].size(-1);
    at::Tensor g = widen(grads[0].reshape({-1, n_out}));
    if (task_should_compute_output(0)) {
      TORCH_CHECK(w_saved.defined(), "the bf16 linear's backward already ran (retain_graph)");
      out[0] = g.mm(widen(w_saved)).to(at::kBFloat16).to(x_type).reshape(x_sizes);
    }
    if (task_should_compute_output(1)) {
      TORCH_CHECK(x_saved.defined(), "the bf16 linear's backward already ran (retain_graph)");
      out[1] = g.t().mm(widen(x_saved)).to(at::kBFloat16).to(w_type);
    }
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    xb.reset();
    wb.reset();
  }
};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [out, in], got ", w.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "input ", x.sizes(), " does not fit weight ", w.sizes());
  TORCH_CHECK(
      at::isFloatingType(x.scalar_type()) && at::isFloatingType(w.scalar_type()),
      "bf16 linear takes floating tensors, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.device() == w.device(), "input on ", x.device(), ", weight on ", w.device());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const bool x_grad = torch::autograd::compute_requires_grad(x);
  const bool w_grad = torch::autograd::compute_requires_grad(w);
  at::Tensor xb, wb, y;
  {
    at::NoGradGuard no_grad;
    xb = x.to(at::kBFloat16).reshape({-1, x.size(-1)});
    wb = w.to(at::kBFloat16);
    y = at::mm(widen(xb), widen(wb).t()).to(at::kBFloat16);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    y = y.view(shape);
  }
  if (x_grad || w_grad) {
    auto node = c10::make_intrusive<Bf16LinearBackward>(torch::autograd::collect_next_edges(x, w));
    node->x_sizes = x.sizes().vec();
    node->x_type = x.scalar_type();
    node->w_type = w.scalar_type();
    if (w_grad) {
      node->xb = xb;
    }
    if (x_grad) {
      node->wb = wb;
    }
    torch::autograd::set_history(y, c10::intrusive_ptr<torch::autograd::Node>(std::move(node)));
  }
  return y;
}

}  // namespace

extern "C" {

// `lsdk::cpu_has_fast_bf16_gemm()` (guard.h): 1 or 0 in `fast`.
char* lsdk_cpu_has_fast_bf16_gemm(int32_t* fast) {
  return lsdk::guarded([&] {
    TORCH_CHECK(fast != nullptr, "null output");
    *fast = lsdk::cpu_has_fast_bf16_gemm() ? 1 : 0;
  });
}

// `x · Wᵀ` (x `[..., in]`, W `[out, in]`, any floating dtypes, one device) as bf16 autocast
// computes it — operands rounded to bf16, the result `[..., out]` in bf16 — but by f32 GEMMs on
// the widened operands, forward and backward (see the top of this file). An autograd op when x or
// W takes a gradient.
char* lsdk_bf16_linear(const at::Tensor* x, const at::Tensor* w, at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(x != nullptr && w != nullptr && y != nullptr, "null tensor");
    *y = new at::Tensor(bf16_linear(*x, *w));
  });
}

}  // extern "C"
