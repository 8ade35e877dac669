// Data-parallel collectives over PyTorch's own c10d, as libtorch 2.13 ships it: a TCPStore for
// the rendezvous (torchrun's MASTER_ADDR / MASTER_PORT protocol: rank 0 serves the store, the
// others connect) and ProcessGroupGloo for the collectives (its code lives in libtorch_cpu.so;
// the wheel carries c10d's headers but not gloo's, which the build takes from Debian's
// libgloo-dev). Compiled with USE_C10D_GLOO only when those headers were found; otherwise every
// entry point reports that this build has no Gloo.
//
// Same error convention as shim.cpp: NULL on success, else a malloc'ed message.
//
// Headers checked against libtorch 2.13: torch/csrc/distributed/c10d/{TCPStore,PrefixStore,
// ProcessGroupGloo,Types}.hpp.

#include <ATen/core/Tensor.h>

#include "guard.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#endif

namespace {

using lsdk::guarded;

#ifdef USE_C10D_GLOO
struct ProcessGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
};

// Gloo's collectives take one tensor per device; a CPU process hands over one tensor.
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

const char* kNoGloo =
    "this build of lora-core has no Gloo: gloo's C++ headers were not found when it was compiled "
    "(set LORA_GLOO_INCLUDE to a folder holding gloo/algorithm.h — `cargo xtask setup` provisions "
    "assets/gloo/include from Debian's libgloo-dev — or install libgloo-dev, then rebuild)";

}  // namespace

extern "C" {

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
    TORCH_CHECK(host != nullptr && out != nullptr && prefix != nullptr, "null argument");
    TORCH_CHECK(world_size >= 1, "world_size must be at least 1, got ", world_size);
    TORCH_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is outside 0..", world_size);
    TORCH_CHECK(port > 0 && port < 65536, "port ", port, " is not a TCP port");
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = rank == 0;
    o.numWorkers = world_size;
    o.waitWorkers = true;
    o.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
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
#ifdef USE_C10D_GLOO
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
#ifdef USE_C10D_GLOO
    auto tensors = one_tensor(t);
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    group_of(pg)->gloo->allreduce(tensors, o)->wait();
#else
    (void)pg, (void)t;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

// In place: every rank's `t` becomes rank `root`'s.
char* lsdk_dist_broadcast(void* pg, const at::Tensor* t, int32_t root) {
  return guarded([&] {
#ifdef USE_C10D_GLOO
    auto tensors = one_tensor(t);
    c10d::BroadcastOptions o;
    o.rootRank = root;
    group_of(pg)->gloo->broadcast(tensors, o)->wait();
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
#ifdef USE_C10D_GLOO
    auto inputs = one_tensor(t);
    TORCH_CHECK(out != nullptr, "null output tensor");
    auto* g = group_of(pg);
    const int64_t world = g->gloo->getSize();
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
    group_of(pg)->gloo->allgather(outputs, inputs, c10d::AllgatherOptions())->wait();
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
#ifdef USE_C10D_GLOO
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
#ifdef USE_C10D_GLOO
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
#ifdef USE_C10D_GLOO
    group_of(pg)->gloo->barrier()->wait();
#else
    (void)pg;
    TORCH_CHECK(false, kNoGloo);
#endif
  });
}

}  // extern "C"
