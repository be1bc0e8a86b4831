// A model of TF's BFC allocator (tsl/framework/bfc_allocator.cc), the allocator
// of every GPU and of the CPU test bed (TF_CPU_ALLOCATOR_USE_BFC=true).
//
// BFC hands out whole free chunks: it splits a chunk only when it is at least twice
// the request (or the rest is at least 128 MiB), so a 72 MiB tensor placed in a
// free 128 MiB chunk costs 128 MiB. What TF's peak (get_memory_info()["peak"])
// reports, and what runs out, is this chunk-level usage, not the sum of tensor
// sizes. The model replays allocations and frees with BFC's rules: 256-byte
// rounding, best fit (smallest chunk, then lowest address), the split rule,
// coalescing of free neighbours, and regions that start at 2 MiB and double
// (allow_growth), never merged with each other. A pool that already holds a large
// region when the step starts (a GPU without memory growth holds its whole memory as
// one; tfmemopt.enable() reserves one on the CPU test bed, docs/allocator.md) is
// modelled by making that region first. A pool the pass could read (the allocator of
// the process it runs in, grappler/analyze/allocator_state.h) is loaded as it is.
#ifndef TFMEMOPT_GRAPPLER_SIMULATE_BFC_ALLOCATOR_MODEL_H_
#define TFMEMOPT_GRAPPLER_SIMULATE_BFC_ALLOCATOR_MODEL_H_

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"

namespace tfmemopt {

// One chunk of a BFC pool as BFC lists it (RecordMemoryMap: address order).
struct PoolChunk {
  int64_t address = 0;
  int64_t bytes = 0;
  bool in_use = false;
};

class BfcAllocatorModel {
 public:
  // `first_region_bytes` > 0: the pool starts with one free region of that many
  // bytes (at most the limit), after the regions growth starts with (2 MiB, 4 MiB,
  // ...) that fit in the rest of the limit (the layout ReserveCpuPool makes).
  explicit BfcAllocatorModel(int64_t memory_limit, int64_t first_region_bytes = 0);

  // Starts from a pool read off a live allocator (`chunks` in address order, as
  // RecordMemoryMap lists them), in place of the regions made so far: a run of
  // chunks whose addresses follow on is one region (the sub-allocator's mmaps are
  // not adjacent). Chunks in use are held, uncounted in bytes_in_use(), until
  // Claim() says a buffer of the step holds one; the growth of later regions
  // continues from the largest region made by doubling.
  void LoadPool(const std::vector<PoolChunk>& chunks);
  // The loaded chunks in use that no Claim() took yet: (bytes, address), smallest first.
  const absl::btree_set<std::pair<int64_t, int64_t>>& unclaimed() const { return held_; }
  // A loaded chunk in use (by address) holds one of the step's buffers: it counts in
  // bytes_in_use() from now on and Free(address) frees it. Returns the id, or -1.
  int64_t Claim(int64_t address);

  // Returns an id for the allocation, or -1 if BFC would run out of memory.
  int64_t Allocate(int64_t bytes);
  void Free(int64_t id);

  // A region (an address range BFC got from its sub-allocator in one piece), its
  // chunks in address order: (address, bytes, in use).
  struct RegionChunks {
    int64_t bytes = 0;
    std::vector<std::tuple<int64_t, int64_t, bool>> chunks;
  };
  // The regions of at least `min_bytes`, in the order they were made.
  std::vector<RegionChunks> Regions(int64_t min_bytes) const;
  // The largest free chunk, and the bytes BFC may still add as regions.
  int64_t largest_free_bytes() const { return free_.empty() ? 0 : free_.rbegin()->first; }
  int64_t unallocated_bytes() const { return memory_limit_ - pool_; }
  // What a request of `bytes` is rounded to.
  static int64_t RoundedBytes(int64_t bytes);

  int64_t bytes_in_use() const { return in_use_; }
  int64_t peak_bytes_in_use() const { return peak_; }
  int64_t pool_bytes() const { return pool_; }
  void ResetPeak() { peak_ = in_use_; }

 private:
  struct Chunk {
    int64_t size = 0;
    int region = 0;
    bool in_use = false;
  };
  bool Extend(int64_t rounded);
  void AddRegion(int64_t bytes);
  void InsertFree(int64_t address);

  int64_t memory_limit_;
  int64_t next_region_bytes_ = 2 << 20;
  int64_t next_address_ = int64_t{1} << 56;  // regions are placed below it
  int next_region_ = 0;
  int64_t in_use_ = 0;
  int64_t peak_ = 0;
  int64_t pool_ = 0;
  // B-trees rather than std::map/set: a simulation of a loop replays every
  // iteration's allocations, and the planner simulates many plans.
  absl::btree_map<int64_t, Chunk> chunks_;             // by address
  absl::btree_set<std::pair<int64_t, int64_t>> free_;  // (size, address)
  absl::btree_set<std::pair<int64_t, int64_t>> held_;  // LoadPool's, unclaimed
};

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_SIMULATE_BFC_ALLOCATOR_MODEL_H_
