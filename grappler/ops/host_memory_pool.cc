#include "grappler/ops/host_memory_pool.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"

namespace tfmemopt {

namespace {
constexpr char kHostPoolAllocatorName[] = "tfmemopt_host_pool";
}  // namespace

// One swapped-out tensor's bytes. Ref-counted by the Tensors that share it; the
// last Unref hands the block back to the pool.
class HostPoolBuffer : public tensorflow::TensorBuffer {
 public:
  HostPoolBuffer(void* data, size_t bytes, HostMemoryPool* pool)
      : TensorBuffer(data), bytes_(bytes), pool_(pool) {}

  ~HostPoolBuffer() override { pool_->Release(data(), bytes_); }

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
  const size_t allocation = HostPoolBuffer::AllocationSize(bytes);
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cached_by_size_.find(allocation); it != cached_by_size_.end()) {
      data = it->second->second;
      cached_.erase(it->second);
      cached_by_size_.erase(it);
      stats_.cached_bytes -= static_cast<int64_t>(allocation);
    }
  }
  if (data == nullptr) data = std::aligned_alloc(kAlignment, allocation);
  if (data == nullptr) return nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_in_use += static_cast<int64_t>(bytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.bytes_in_use);
    allocated_in_use_ += static_cast<int64_t>(allocation);
    highest_allocated_in_use_ = std::max(highest_allocated_in_use_, allocated_in_use_);
    ++stats_.swap_outs;
  }
  return new HostPoolBuffer(data, bytes, this);
}

void HostMemoryPool::RecordSwapIn() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.swap_ins;
}

void HostMemoryPool::Release(void* data, size_t bytes) {
  const size_t allocation = HostPoolBuffer::AllocationSize(bytes);
  std::vector<void*> to_free;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_in_use -= static_cast<int64_t>(bytes);
    allocated_in_use_ -= static_cast<int64_t>(allocation);
    cached_by_size_.emplace(allocation, cached_.emplace(cached_.end(), allocation, data));
    stats_.cached_bytes += static_cast<int64_t>(allocation);
    while (stats_.cached_bytes > highest_allocated_in_use_) {
      const auto [oldest_size, oldest_data] = cached_.front();
      auto range = cached_by_size_.equal_range(oldest_size);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second == cached_.begin()) {
          cached_by_size_.erase(it);
          break;
        }
      }
      cached_.pop_front();
      stats_.cached_bytes -= static_cast<int64_t>(oldest_size);
      to_free.push_back(oldest_data);
    }
  }
  for (void* block : to_free) std::free(block);
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
