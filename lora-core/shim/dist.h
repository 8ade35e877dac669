// What dist.cpp (Gloo, the collectives) and dist_nccl.cpp (the NCCL process group) share: the
// process group handle and the rendezvous store. LSDK_C10D is defined when this build has at
// least one c10d backend.
#pragma once

#include <ATen/core/Tensor.h>

#include "guard.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#if defined(USE_C10D_GLOO) || defined(USE_C10D_NCCL)
#define LSDK_C10D 1
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#endif
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace lsdk {

#ifdef LSDK_C10D
// A joined group: the store every rank reached and the backend that runs the collectives.
struct ProcessGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

// The rendezvous at `host:port` as torchrun does it: rank 0 serves a TCPStore, the others
// connect; waits up to `timeout` for all `world_size` ranks. Keys live under `prefix` (one
// group per run).
inline c10::intrusive_ptr<c10d::Store> join_store(const char* host, int32_t port, int32_t rank,
                                                  int32_t world_size,
                                                  std::chrono::milliseconds timeout,
                                                  const char* prefix) {
  TORCH_CHECK(host != nullptr && prefix != nullptr, "null argument");
  TORCH_CHECK(world_size >= 1, "world_size must be at least 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is outside 0..", world_size);
  TORCH_CHECK(port > 0 && port < 65536, "port ", port, " is not a TCP port");
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = rank == 0;
  o.numWorkers = world_size;
  o.waitWorkers = true;
  o.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
  return c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
}
#endif

}  // namespace lsdk
