// HostMemoryPool: the host tier that swapped-out tensors live in.
//
// On the CPU test bed, "device memory" is TF's CPU allocator capped with
// TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB. A swap only lowers
// that allocator's peak if the swapped bytes live somewhere else, so the pool
// allocates with the C library (never through a TF Allocator) and hands each
// allocation out as a TensorBuffer: a Tensor built on it
// (Tensor(DataType, TensorShape, TensorBuffer*)) flows through the graph like any
// other, and the bytes go back to the pool when its last reference is dropped.
//
// The pool keeps freed blocks for the next swap-out of the same size: a training
// loop swaps the same tensor sizes every step, and faulting in fresh pages costs
// more than the copy itself (benchmarks/host_bandwidth.py). The cache never holds
// more bytes than the live blocks did at their highest; beyond that, the least
// recently freed blocks go back to the system first.
//
// The pool is process-wide and thread-safe; it counts bytes in use, their peak,
// the bytes cached, and the swap-outs and swap-ins performed.
#ifndef TFMEMOPT_GRAPPLER_OPS_HOST_MEMORY_POOL_H_
#define TFMEMOPT_GRAPPLER_OPS_HOST_MEMORY_POOL_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <utility>

#include "tensorflow/core/framework/tensor.h"

namespace tfmemopt {

struct HostPoolStats {
  int64_t bytes_in_use = 0;  // bytes held by live host buffers
  int64_t peak_bytes = 0;    // highest bytes_in_use since start or ResetPeak()
  int64_t swap_outs = 0;     // buffers handed out (one per executed swap-out)
  int64_t swap_ins = 0;      // executed swap-ins
  int64_t cached_bytes = 0;  // freed blocks kept for reuse (allocated sizes)
};

class HostMemoryPool {
 public:
  // Alignment of every buffer: what Eigen expects of TF tensors
  // (EIGEN_MAX_ALIGN_BYTES=64), so a consumer may read the stash directly.
  static constexpr size_t kAlignment = 64;

  static HostMemoryPool* Global();

  // A buffer of `bytes` (may be 0) outside TF's allocators, with one reference
  // owned by the caller, and counted as one swap-out. Returns nullptr if the host
  // is out of memory.
  tensorflow::TensorBuffer* AllocateForSwapOut(size_t bytes);

  void RecordSwapIn();

  HostPoolStats Stats() const;
  // Restarts peak tracking from the bytes in use now.
  void ResetPeak();

 private:
  friend class HostPoolBuffer;
  // Called by the buffer's destructor: caches or frees `data`.
  void Release(void* data, size_t bytes);

  mutable std::mutex mu_;
  HostPoolStats stats_;
  // Live blocks by allocated size, and their highest total: the cache's bound
  // (ResetPeak() keeps it).
  int64_t allocated_in_use_ = 0;
  int64_t highest_allocated_in_use_ = 0;
  // Cached blocks, least recently freed first, and an index by allocated size.
  using CachedList = std::list<std::pair<size_t, void*>>;
  CachedList cached_;
  std::multimap<size_t, CachedList::iterator> cached_by_size_;
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_OPS_HOST_MEMORY_POOL_H_
