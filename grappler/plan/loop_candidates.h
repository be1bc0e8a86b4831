// Plan: which loop accumulators to swap (rewrite/loop_swap.h), as candidates the
// planner weighs like any other swap: bytes saved at the simulated peak against
// the time of their copies.
#ifndef TFMEMOPT_GRAPPLER_PLAN_LOOP_CANDIDATES_H_
#define TFMEMOPT_GRAPPLER_PLAN_LOOP_CANDIDATES_H_

#include <cstdint>
#include <vector>

#include "grappler/analyze/tensor_table.h"

namespace tfmemopt {

struct LoopSwapCandidate {
  int list = -1;         // TensorTable::loops.lists index
  int64_t gain = 0;      // device bytes the list holds at its fullest
  double seconds = 0;    // its copies' predicted time not hidden by compute
};

// The swappable lists of `table` (LoopSwapBlocker is "") whose buffer is among
// `live_at_peak` (buffer indices), hold at least `min_bytes`, and are not in
// `chosen`. Each list is copied out once and back once per step:
// 2 x bytes / bandwidth, times `exposure` (the part of a copy compute does not hide).
std::vector<LoopSwapCandidate> LoopSwapCandidates(const TensorTable& table,
                                                  const std::vector<int>& live_at_peak,
                                                  const std::vector<int>& chosen,
                                                  int64_t min_bytes, double bandwidth,
                                                  double exposure);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_LOOP_CANDIDATES_H_
