// Analyze: sums whose terms TF adds in the order they finish.
//
// Two TF rewrites turn a sum of three or more tensors into a TemporaryVariable that
// each term is AssignAdd-ed into as soon as it exists, so that a term's buffer is
// freed before the last one is computed:
//  - Grappler's built-in memory optimizer (memory_optimizer.cc, SchedulingPass, on at
//    TF's default memory_optimization level) rewrites an AddN of more than two inputs
//    whose terms are live at the peak it estimates, when that peak is above 80 % of
//    the device's memory (256 MiB for a CPU device, so most training steps of a
//    real model). The pass sees the result: TemporaryVariable, its Assign from
//    ZerosLike (a Const once constant folding has run), one AssignAdd per term,
//    DestroyTemporaryVariable named as the AddN.
//  - The graph pass that replaces AccumulateNV2 (accumulate_n_optimizer.cc, before
//    placement) writes the same pattern, its accumulator zeroed from a Const; the
//    Python grappler API (tfmemopt.analyze) skips that pass and hands the pass the
//    AccumulateNV2 itself.
// Float addition is not associative: the result of such a sum depends on the order
// in which its terms finish, which the executor decides. With several inter-op
// threads TF's own result then differs from run to run; with one it follows the
// graph's execution order, which every memory rewrite (a recompute's clone, a
// swap-in, an ordering edge) changes. These sums are where tfmemopt's results can
// differ from TF's in the last bits although every op computes what it computed
// before; the report names them (docs/design.md#arrival-order-sums).
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_ARRIVAL_ORDER_SUMS_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_ARRIVAL_ORDER_SUMS_H_

#include <string>
#include <vector>

#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

struct ArrivalOrderSum {
  // The DestroyTemporaryVariable that yields the sum (the AddN or AccumulateNV2 it
  // replaced keeps its name), the TemporaryVariable when there is none, or the
  // AccumulateNV2 itself.
  std::string name;
  int terms = 0;
};

// The sums of `graph` with three or more terms added in arrival order, in graph
// order. Two terms add up to the same float in either order, so they are left out.
std::vector<ArrivalOrderSum> FindArrivalOrderSums(const tensorflow::GraphDef& graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_ARRIVAL_ORDER_SUMS_H_
