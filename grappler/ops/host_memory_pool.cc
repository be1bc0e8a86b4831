#include "grappler/ops/host_memory_pool.h"

#include <algorithm>
#include <cstdlib>

#include "tensorflow/core/framework/allocation_description.pb.h"

namespace tfmemopt {

inline constexpr char kHostPoolAllocatorName[] = "tfmemopt_host_pool";

// One swapped-out tensor's bytes. Ref-counted by the Tensors that share it; the
// last Unref frees the memory and returns its bytes to the pool's count.
class HostPoolBuffer : public tensorflow::TensorBuffer {
 public:
  HostPoolBuffer(void* data, size_t bytes, HostMemoryPool* pool)
      : TensorBuffer(data), bytes_(bytes), pool_(pool) {}

  ~HostPoolBuffer() override {
    std::free(data());
    pool_->Release(bytes_);
  }

  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocated_bytes(static_cast<int64_t>(AllocationSize(bytes_)));
    proto->set_allocator_name(kHostPoolAllocatorName);
  }
  bool GetAllocatedBytes(size_t* out_bytes) const override {
    *out_bytes = AllocationSize(bytes_);
    return true;
  }
  tensorflow::AllocatorMemoryType GetMemoryType() const override {
    return tensorflow::AllocatorMemoryType::kHostPageable;
  }

  // aligned_alloc wants a positive multiple of the alignment.
  static size_t AllocationSize(size_t bytes) {
    const size_t a = HostMemoryPool::kAlignment;
    return std::max<size_t>(a, (bytes + a - 1) / a * a);
  }

 private:
  const size_t bytes_;
  HostMemoryPool* const pool_;
};

HostMemoryPool* HostMemoryPool::Global() {
  // Never destroyed: buffers may outlive static destruction at process exit.
  static HostMemoryPool* pool = new HostMemoryPool;
  return pool;
}

tensorflow::TensorBuffer* HostMemoryPool::AllocateForSwapOut(size_t bytes) {
  void* data = std::aligned_alloc(kAlignment, HostPoolBuffer::AllocationSize(bytes));
  if (data == nullptr) return nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_in_use += static_cast<int64_t>(bytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes_in_use);
    ++stats_.swap_outs;
  }
  return new HostPoolBuffer(data, bytes, this);
}

void HostMemoryPool::RecordSwapIn() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.swap_ins;
}

void HostMemoryPool::Release(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_in_use -= static_cast<int64_t>(bytes);
}

HostPoolStats HostMemoryPool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void HostMemoryPool::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.bytes_in_use;
}

}  // namespace tfmemopt
