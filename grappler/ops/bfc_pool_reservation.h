// Reserving the BFC pool as one region.
//
// With allow_growth, TF's BFC allocator takes memory from its sub-allocator in
// regions of 2 MiB, 4 MiB, 8 MiB, ... and never merges or returns them; a tensor
// must fit in one free chunk of one region. The CPU test bed always grows
// (process_state.cc sets allow_growth), so a plan whose peak is under the limit can
// still be refused a 50 MiB tensor with 200 MiB free across regions
// (docs/allocator.md). A GPU without memory growth, TF's default, holds its whole
// memory as one region from the start and has no such refusals.
//
// ReserveCpuPool() gives the CPU allocator that layout: one allocation of all that
// its limit still allows, freed at once. BFC makes a region of exactly that size
// for it and keeps the region, so every large tensor is placed in one region, as on
// a GPU without growth. In an empty pool the regions growth starts with (2 MiB,
// 4 MiB, ... up to an eighth of the limit) are made first, so that small
// allocations stay apart from the large ones as they do in a growing pool. The pages are not touched, so the reservation costs no
// resident memory until tensors use it.
#ifndef TFMEMOPT_GRAPPLER_OPS_BFC_POOL_RESERVATION_H_
#define TFMEMOPT_GRAPPLER_OPS_BFC_POOL_RESERVATION_H_

#include <cstdint>
#include <string>

namespace tfmemopt {

struct PoolReservation {
  // The large region made, in bytes (0: none); the small ones hold the rest of the
  // pool (pool_bytes - region_bytes).
  int64_t region_bytes = 0;
  // The allocator's limit and the bytes its regions hold, after the reservation.
  int64_t limit_bytes = 0;
  int64_t pool_bytes = 0;
  // Why nothing was reserved ("" when a region was made).
  std::string reason;
};

// Reserves the rest of the CPU allocator's limit as one region when that allocator
// is BFC (the test bed: TF_CPU_ALLOCATOR_USE_BFC=true) and at least
// `min_region_bytes` of its limit is not yet in regions. Creates the process's CPU
// allocator if TF has not yet (the one TF's CPU devices use later), but not TF's
// eager context, so it is safe before any other TF call. The allocator's peak
// statistics are cleared afterwards, so get_memory_info() does not count the
// reservation.
PoolReservation ReserveCpuPool(int64_t min_region_bytes);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_OPS_BFC_POOL_RESERVATION_H_
