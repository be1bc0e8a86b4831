#include "grappler/analyze/allocator_state.h"

#include "tensorflow/core/common_runtime/process_state.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/platform/numa.h"
#include "xla/tsl/framework/bfc_allocator.h"
#include "xla/tsl/protobuf/bfc_memory_map.pb.h"

namespace tfmemopt {

// process_state.cc makes the test bed's CPU allocator a BFCAllocator of this name,
// and wraps it only in a TrackingAllocator for allocators that do not track sizes,
// which BFC does.
constexpr char kCpuBfcName[] = "bfc_cpu_allocator_for_gpu";

std::vector<PoolChunk> ReadBfcPool(tsl::Allocator* allocator) {
  std::vector<PoolChunk> chunks;
  if (allocator == nullptr || allocator->Name() != kCpuBfcName) return chunks;
  const tensorflow::MemoryDump dump =
      static_cast<tsl::BFCAllocator*>(allocator)->RecordMemoryMap();
  chunks.reserve(dump.chunk_size());
  for (const tensorflow::MemChunk& chunk : dump.chunk()) {
    chunks.push_back({static_cast<int64_t>(chunk.address()), static_cast<int64_t>(chunk.size()),
                      chunk.in_use()});
  }
  return chunks;
}

std::vector<PoolChunk> ReadCpuPool() {
  return ReadBfcPool(
      tensorflow::ProcessState::singleton()->GetCPUAllocator(tensorflow::port::kNUMANoAffinity));
}

}  // namespace tfmemopt
