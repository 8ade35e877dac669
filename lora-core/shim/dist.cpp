// Data-parallel collectives over PyTorch's own c10d, as libtorch 2.13 ships it: a TCPStore for
// the rendezvous (torchrun's MASTER_ADDR / MASTER_PORT protocol: rank 0 serves the store, the
// others connect) and a c10d backend for the collectives: ProcessGroupGloo on the CPU (its code
// lives in libtorch_cpu.so; the wheel carries c10d's headers but not gloo's, which the build
// takes from Debian's libgloo-dev), ProcessGroupNCCL on CUDA (`dist_nccl.cpp`, its code in
// libtorch_cuda.so). Compiled with USE_C10D_GLOO / USE_C10D_NCCL only when their headers were
// found; otherwise the entry points report which backend this build lacks.
//
// Same error convention as shim.cpp: NULL on success, else a malloc'ed message.
//
// Headers checked against libtorch 2.13: torch/csrc/distributed/c10d/{TCPStore,PrefixStore,
// ProcessGroupGloo,ProcessGroupNCCL,Backend,Types}.hpp.

#include "dist.h"

namespace {

using lsdk::guarded;

#ifdef LSDK_C10D
using lsdk::ProcessGroup;

// A c10d backend's collectives take one tensor per device; a process hands over one tensor.
std::vector<at::Tensor> one_tensor(const at::Tensor* t) {
  TORCH_CHECK(t != nullptr, "null tensor");
  TORCH_CHECK(t->is_contiguous(), "the tensor of a collective must be contiguous");
  return {*t};
}

ProcessGroup* group_of(void* pg) {
  TORCH_CHECK(pg != nullptr, "null process group");
  return static_cast<ProcessGroup*>(pg);
}
#endif

#ifndef USE_C10D_NCCL
const char* kNoNccl =
    "this build of lora-core has no NCCL: c10d's NCCL process group needs libtorch_cuda, nccl.h "
    "and the CUDA runtime headers when it is compiled (`cargo xtask setup` provisions "
    "assets/cuda/include; LORA_CUDA_INCLUDE names another folder), then rebuild";
#endif

const char* kNoGloo =
    "this build of lora-core has no Gloo: gloo's C++ headers were not found when it was compiled "
    "(set LORA_GLOO_INCLUDE to a folder holding gloo/algorithm.h — `cargo xtask setup` provisions "
    "assets/gloo/include from Debian's libgloo-dev — or install libgloo-dev, then rebuild)";

}  // namespace

extern "C" {

// 1 when this build has c10d's NCCL process group.
char* lsdk_dist_has_nccl(int32_t* has) {
  return guarded([&] {
#ifdef USE_C10D_NCCL
    *has = 1;
#else
    *has = 0;
#endif
  });
}

#ifndef USE_C10D_NCCL
// The NCCL process group's constructor; this build has none (see dist_nccl.cpp).
char* lsdk_dist_nccl_new(const char* host, int32_t port, int32_t rank, int32_t world_size,
                         int64_t timeout_ms, const char* prefix, int32_t device_index,
                         void** out) {
  return guarded([&] {
    (void)host, (void)port, (void)rank, (void)world_size, (void)timeout_ms, (void)prefix;
    (void)device_index, (void)out;
    TORCH_CHECK(false, kNoNccl);
  });
}
#endif

// 1 when this build has c10d's Gloo process group.
char* lsdk_dist_has_gloo(int32_t* has) {
  return guarded([&] {
#ifdef USE_C10D_GLOO
    *has = 1;
#else
    *has = 0;
#endif
  });
}

// Joins the group `world_size` processes form at `host:port` (rank 0 serves the TCPStore there),
// with collectives over Gloo on the interface that reaches `host`; `timeout_ms` bounds the
// rendezvous and each collective. `prefix` namespaces the store's keys (one group per run).
char* lsdk_dist_gloo_new(
    const char* host,
    int32_t port,
    int32_t rank,
    int32_t world_size,
    int64_t timeout_ms,
    const char* prefix,
    void** out) {
  return guarded([&] {
#ifdef USE_C10D_GLOO
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto store = lsdk::join_store(host, port, rank, world_size, timeout, prefix);
    TORCH_CHECK(out != nullptr, "null argument");
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = timeout;
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(std::string(host)));
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, opts);
    *out = new ProcessGroup{store, gloo};
#else
    (void)host, (void)port, (void)rank, (void)world_size, (void)timeout_ms, (void)prefix;
    (void)out;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

char* lsdk_dist_free(void* pg) {
  return guarded([&] {
#ifdef LSDK_C10D
    delete static_cast<ProcessGroup*>(pg);
#else
    (void)pg;
#endif
  });
}

// In-place sum of `t` over all ranks (every rank ends with the same values). `t` must be
// contiguous and of the same shape and dtype on every rank.
char* lsdk_dist_all_reduce_sum(void* pg, const at::Tensor* t) {
  return guarded([&] {
#ifdef LSDK_C10D
    auto tensors = one_tensor(t);
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    group_of(pg)->backend->allreduce(tensors, o)->wait();
#else
    (void)pg, (void)t;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// In place: every rank's `t` becomes rank `root`'s.
char* lsdk_dist_broadcast(void* pg, const at::Tensor* t, int32_t root) {
  return guarded([&] {
#ifdef LSDK_C10D
    auto tensors = one_tensor(t);
    c10d::BroadcastOptions o;
    o.rootRank = root;
    group_of(pg)->backend->broadcast(tensors, o)->wait();
#else
    (void)pg, (void)t, (void)root;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// Every rank's `t`, in rank order, into `out` ([world_size, *t.shape], t's dtype, contiguous).
// Gloo's all-gather takes one output tensor per rank: rows of `out`, written back in place.
char* lsdk_dist_all_gather(void* pg, const at::Tensor* t, const at::Tensor* out) {
  return guarded([&] {
#ifdef LSDK_C10D
    auto inputs = one_tensor(t);
    TORCH_CHECK(out != nullptr, "null output tensor");
    auto* g = group_of(pg);
    const int64_t world = g->backend->getSize();
    TORCH_CHECK(out->is_contiguous(), "the all-gather output must be contiguous");
    TORCH_CHECK(out->dim() == t->dim() + 1 && out->size(0) == world,
                "the all-gather output must be [world_size=", world, ", *input.shape], got ",
                out->sizes());
    TORCH_CHECK(out->scalar_type() == t->scalar_type(), "the all-gather output must be ",
                t->scalar_type(), ", got ", out->scalar_type());
    std::vector<at::Tensor> rows;
    rows.reserve(world);
    for (int64_t r = 0; r < world; ++r) {
      rows.push_back(out->select(0, r));
      TORCH_CHECK(rows.back().sizes() == t->sizes(), "all-gather row ", r, " is ",
                  rows.back().sizes(), ", the input ", t->sizes());
    }
    std::vector<std::vector<at::Tensor>> outputs{rows};
    group_of(pg)->backend->allgather(outputs, inputs, c10d::AllgatherOptions())->wait();
#else
    (void)pg, (void)t, (void)out;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// Adds `delta` to the integer under `key` in the group's store (created at 0) and returns the
// sum in `value`: how ranks leave marks for each other outside the collectives.
char* lsdk_dist_store_add(void* pg, const char* key, int64_t delta, int64_t* value) {
  return guarded([&] {
#ifdef LSDK_C10D
    TORCH_CHECK(key != nullptr && value != nullptr, "null argument");
    *value = group_of(pg)->store->add(std::string(key), delta);
#else
    (void)pg, (void)key, (void)delta, (void)value;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// Whether `key` is in the group's store (without waiting for it).
char* lsdk_dist_store_check(void* pg, const char* key, int32_t* present) {
  return guarded([&] {
#ifdef LSDK_C10D
    TORCH_CHECK(key != nullptr && present != nullptr, "null argument");
    *present = group_of(pg)->store->check({std::string(key)}) ? 1 : 0;
#else
    (void)pg, (void)key, (void)present;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// Waits until every rank has reached the barrier.
char* lsdk_dist_barrier(void* pg) {
  return guarded([&] {
#ifdef LSDK_C10D
    group_of(pg)->backend->barrier()->wait();
#else
    (void)pg;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

}  // extern "C"
