#include "grappler/simulate/bfc_allocator_model.h"

#include <algorithm>
#include <iterator>

namespace tfmemopt {
namespace {

constexpr int64_t kMinAllocationSize = 256;
constexpr int64_t kMaxInternalFragmentation = 128LL << 20;

int64_t Rounded(int64_t bytes) {
  return (bytes + kMinAllocationSize - 1) / kMinAllocationSize * kMinAllocationSize;
}

}  // namespace

BfcAllocatorModel::BfcAllocatorModel(int64_t memory_limit, int64_t first_region_bytes)
    : memory_limit_(memory_limit),
      next_region_bytes_(Rounded(std::min<int64_t>(memory_limit, 2 << 20))) {
  // BFC rounds a region down to 256 bytes when it takes the rest of its limit.
  const int64_t first =
      std::min(first_region_bytes, memory_limit) / kMinAllocationSize * kMinAllocationSize;
  if (first <= 0) return;
  // The rest of the limit is in the regions growth starts with (2 MiB, 4 MiB, ...),
  // made before the large one (ReserveCpuPool), or still to grow.
  int64_t rest = memory_limit - first;
  while (next_region_bytes_ <= rest) {
    AddRegion(next_region_bytes_);
    rest -= next_region_bytes_;
    next_region_bytes_ *= 2;
  }
  AddRegion(first);
}

void BfcAllocatorModel::AddRegion(int64_t bytes) {
  // Regions are separate address ranges: a gap keeps chunks of two regions from
  // ever coalescing, as in BFC without region coalescing. Each new region lies
  // below the previous ones: the CPU sub-allocator's posix_memalign serves these
  // sizes with mmap, which Linux places top-down, and BFC breaks a tie between
  // free chunks of one size by the lower address, so it fills the newest region
  // first.
  next_address_ -= bytes + kMinAllocationSize;
  const int64_t address = next_address_;
  chunks_[address] = Chunk{bytes, next_region_++, false};
  free_.insert({bytes, address});
  pool_ += bytes;
}

bool BfcAllocatorModel::Extend(int64_t rounded) {
  const int64_t available = (memory_limit_ - pool_) / kMinAllocationSize * kMinAllocationSize;
  if (rounded > available) return false;
  bool increased = false;
  while (rounded > next_region_bytes_) {
    next_region_bytes_ *= 2;
    increased = true;
  }
  const int64_t bytes = std::min(next_region_bytes_, available);
  if (!increased) next_region_bytes_ *= 2;
  AddRegion(bytes);
  return true;
}

int64_t BfcAllocatorModel::Allocate(int64_t bytes) {
  if (bytes <= 0) return -2;  // nothing to allocate; Free() ignores it
  const int64_t rounded = Rounded(bytes);
  auto it = free_.lower_bound({rounded, -1});
  if (it == free_.end()) {
    if (!Extend(rounded)) return -1;
    it = free_.lower_bound({rounded, -1});
    if (it == free_.end()) return -1;
  }
  const auto [size, address] = *it;
  free_.erase(it);
  // (A btree's insertions and erasures move its elements: no reference into
  // chunks_ is kept across one.)
  auto chunk = chunks_.find(address);
  chunk->second.in_use = true;
  int64_t used = size;
  if (size >= 2 * rounded || size - rounded >= kMaxInternalFragmentation) {
    chunk->second.size = rounded;
    used = rounded;
    const int region = chunk->second.region;
    chunks_.emplace(address + rounded, Chunk{size - rounded, region, false});
    free_.insert({size - rounded, address + rounded});
  }
  in_use_ += used;
  peak_ = std::max(peak_, in_use_);
  return address;
}

void BfcAllocatorModel::InsertFree(int64_t address) {
  auto it = chunks_.find(address);
  int64_t start = address;
  int64_t size = it->second.size;
  const int region = it->second.region;
  // Merge with the next chunk, then with the previous one, when free and in the
  // same region.
  auto next = std::next(it);
  if (next != chunks_.end() && !next->second.in_use && next->second.region == region &&
      next->first == start + size) {
    free_.erase({next->second.size, next->first});
    size += next->second.size;
    chunks_.erase(next);
    it = chunks_.find(start);
    it->second.size = size;
  }
  if (it != chunks_.begin()) {
    auto prev = std::prev(it);
    if (!prev->second.in_use && prev->second.region == region &&
        prev->first + prev->second.size == start) {
      const int64_t prev_start = prev->first;
      free_.erase({prev->second.size, prev_start});
      size += prev->second.size;
      chunks_.erase(it);
      chunks_.find(prev_start)->second.size = size;
      start = prev_start;
    }
  }
  free_.insert({size, start});
}

void BfcAllocatorModel::LoadPool(const std::vector<PoolChunk>& chunks) {
  if (chunks.empty()) return;
  chunks_.clear();
  free_.clear();
  held_.clear();
  pool_ = in_use_ = peak_ = 0;
  // Regions by address, highest (oldest: mmap places them top-down) first, so that
  // region indices keep the order they were made in.
  std::vector<std::pair<size_t, size_t>> runs;  // [first, last] chunk indices
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (i == 0 || chunks[i - 1].address + chunks[i - 1].bytes != chunks[i].address) {
      runs.push_back({i, i});
    } else {
      runs.back().second = i;
    }
  }
  // BFC's next region size, replayed from the regions in the order they were made:
  // a region larger than the size due was made for a request that needed it, and the
  // size stays; one of the size due doubles it (BFCAllocator::Extend).
  int64_t next_bytes = 2 << 20;
  next_region_ = 0;
  for (auto run = runs.rbegin(); run != runs.rend(); ++run) {
    const int region = next_region_++;
    int64_t bytes = 0;
    for (size_t i = run->first; i <= run->second; ++i) {
      const PoolChunk& c = chunks[i];
      chunks_[c.address] = Chunk{c.bytes, region, c.in_use};
      (c.in_use ? held_ : free_).insert({c.bytes, c.address});
      bytes += c.bytes;
    }
    pool_ += bytes;
    if (bytes > next_bytes) {
      while (next_bytes < bytes) next_bytes *= 2;
    } else if (bytes == next_bytes) {
      next_bytes *= 2;
    }  // smaller: the rest of the limit, made last
  }
  next_region_bytes_ = next_bytes;
  next_address_ = std::min(next_address_, chunks.front().address - kMinAllocationSize);
}

int64_t BfcAllocatorModel::Claim(int64_t address) {
  auto it = chunks_.find(address);
  if (it == chunks_.end() || !held_.erase({it->second.size, address})) return -1;
  in_use_ += it->second.size;
  peak_ = std::max(peak_, in_use_);
  return address;
}

int64_t BfcAllocatorModel::RoundedBytes(int64_t bytes) { return Rounded(bytes); }

std::vector<BfcAllocatorModel::RegionChunks> BfcAllocatorModel::Regions(int64_t min_bytes) const {
  std::vector<RegionChunks> regions(next_region_);
  for (const auto& [address, chunk] : chunks_) {
    RegionChunks& region = regions[chunk.region];
    region.bytes += chunk.size;
    region.chunks.emplace_back(address, chunk.size, chunk.in_use);
  }
  std::vector<RegionChunks> out;
  for (RegionChunks& region : regions) {
    if (region.bytes >= min_bytes) out.push_back(std::move(region));
  }
  return out;
}

void BfcAllocatorModel::Free(int64_t id) {
  if (id < 0) return;
  auto it = chunks_.find(id);
  if (it == chunks_.end() || !it->second.in_use) return;
  it->second.in_use = false;
  in_use_ -= it->second.size;
  InsertFree(id);
}

}  // namespace tfmemopt
