#include "grappler/ops/bfc_pool_reservation.h"

#include <unistd.h>

#include <optional>
#include <vector>

#include "tensorflow/core/common_runtime/process_state.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/platform/numa.h"

namespace tfmemopt {

PoolReservation ReserveCpuPool(int64_t min_region_bytes) {
  PoolReservation out;
  tensorflow::Allocator* allocator =
      tensorflow::ProcessState::singleton()->GetCPUAllocator(tensorflow::port::kNUMANoAffinity);
  if (allocator == nullptr) {
    out.reason = "TF has no CPU allocator";
    return out;
  }
  // TF's default CPU allocator hands each tensor its own malloc; only the test bed's
  // ("bfc_cpu_allocator_for_gpu") has regions.
  const std::optional<tensorflow::AllocatorStats> stats = allocator->GetStats();
  if (allocator->Name().find("bfc") == std::string::npos || !stats ||
      !stats->bytes_limit.has_value() || *stats->bytes_limit <= 0) {
    out.reason = "the CPU allocator is not BFC (TF_CPU_ALLOCATOR_USE_BFC is not set)";
    return out;
  }
  out.limit_bytes = *stats->bytes_limit;
  out.pool_bytes = stats->pool_bytes.value_or(0);
  // BFC's Extend() takes the rest of the limit rounded down to 256 bytes; asking for
  // exactly that makes one region of it (the next power-of-two region size is
  // capped by what is left).
  const int64_t available = (out.limit_bytes - out.pool_bytes) / 256 * 256;
  // Without TF_CPU_BFC_MEM_LIMIT_IN_MB the limit is 64 GiB: a region that large
  // may not be mapped at all, and BFC would log an out-of-memory dump for trying.
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0 && available > static_cast<int64_t>(pages) * page_size) {
    out.reason = "the allocator's limit (" + std::to_string(out.limit_bytes) +
                 " bytes) is above the host's RAM; set TF_CPU_BFC_MEM_LIMIT_IN_MB";
    return out;
  }
  if (available < min_region_bytes) {
    out.reason = "only " + std::to_string(available) + " bytes of the allocator's " +
                 std::to_string(out.limit_bytes) + "-byte limit are not in regions yet (" +
                 std::to_string(min_region_bytes) + " are worth a reservation)";
    return out;
  }
  // In an empty pool, first the regions growth would make up to an eighth of the
  // limit (2 MiB, 4 MiB, ...: each request the size BFC grows by next, held so that
  // the next one needs a region of its own). The small allocations TF makes before
  // a step (variables' initial values, Keras' bookkeeping) then land there, by best
  // fit, apart from the step's large tensors, as they do in a growing pool; the
  // memory model replays that layout (BfcAllocatorModel).
  std::vector<void*> blocks;
  int64_t small = 0;
  if (out.pool_bytes == 0) {
    for (int64_t bytes = 2 << 20; small + bytes <= out.limit_bytes / 8; bytes *= 2) {
      void* block = allocator->AllocateRaw(tensorflow::Allocator::kAllocatorAlignment, bytes);
      if (block == nullptr) break;
      blocks.push_back(block);
      small += bytes;
    }
  }
  void* block = allocator->AllocateRaw(tensorflow::Allocator::kAllocatorAlignment,
                                       available - small);
  for (void* b : blocks) allocator->DeallocateRaw(b);
  if (block == nullptr) {
    out.reason = "BFC could not make a region of " + std::to_string(available - small) + " bytes";
    return out;
  }
  allocator->DeallocateRaw(block);
  (void)allocator->ClearStats();
  const std::optional<tensorflow::AllocatorStats> after = allocator->GetStats();
  const int64_t before = out.pool_bytes;
  out.pool_bytes = after && after->pool_bytes ? *after->pool_bytes : before + available;
  out.region_bytes = out.pool_bytes - before - small;
  return out;
}

}  // namespace tfmemopt
