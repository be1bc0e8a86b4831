// Rewrite: splitting per-sample work along the batch. The ops of a region (chosen
// by plan/split_choice.h from analyze/per_sample.h's classification) run as k
// micro-batches one after another, so that only one slice's working set is live:
//  * each region op gets k copies, TfMemOpt/Split/<op>/slice_<i>, that read slice
//    i of their batch inputs and the whole of their other inputs (weights); a
//    slice's shape input (Reshape's shape, ...) becomes a constant of its own;
//  * a batch input from outside the region is cut with one Slice per slice
//    (TfMemOpt/Split/<producer>/cut_<port>_<i>); along dimension 0 of a tensor
//    whose rows are 64-byte aligned TF's Slice hands out a view of its input, so a
//    cut usually costs no memory;
//  * an output the rest of the graph reads is joined: per-sample outputs by a
//    ConcatV2 along the batch (TfMemOpt/Split/<op>/join_<port>), batch reductions
//    (weight gradients) by summing the slices' partial sums in slice order
//    (TfMemOpt/Split/<op>/sum_<port>_<i>, AddV2);
//  * slice i + 1 of a stage starts when slice i is done: a NoOp
//    (TfMemOpt/Split/<first op>/done_<stage>_<i>) waits for the slice's last ops,
//    and the slice's first ops and cuts wait for it (control edges).
// A stage is a part of the region that no path leaves and re-enters: when the
// loss's gradient does not depend on the whole batch (a mean), the forward and
// backward passes of a slice form one stage, and each micro-batch runs forward and
// backward before the next begins; otherwise the backward slices form a later
// stage, and read the forward slices' tensors (which the planner may then
// recompute per slice).
// Shape, ShapeN, Size and Rank ops outside the region that read a region tensor
// are replaced by constants (their value is static), so that no full-batch tensor
// has to be joined only for its shape. The original region ops are removed.
//
// The rewrite builds a new GraphDef, which the planner analyzes afresh (its own
// shapes, sizes, costs and order): what is simulated is what runs.
#ifndef TFMEMOPT_GRAPPLER_REWRITE_SPLIT_PASS_H_
#define TFMEMOPT_GRAPPLER_REWRITE_SPLIT_PASS_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/per_sample.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

inline constexpr char kSplitScope[] = "TfMemOpt/Split/";

struct SplitSpec {
  std::vector<int> nodes;  // region nodes: table indices, per-sample or reductions
  int slices = 2;          // k, at most the batch size
  // Nodes that must stay as they are (fetches, the item's nodes to preserve).
  std::set<std::string> preserved;
};

struct SplitSummary {
  int stages = 0;
  int region_nodes = 0;
  int added_nodes = 0;   // nodes of the output that the input did not have
  int cuts = 0;          // tensors cut along the batch
  int joins = 0;         // per-sample outputs concatenated
  int sums = 0;          // reductions summed over the slices
  int shape_constants = 0;  // shape ops outside the region replaced by constants
  std::vector<int64_t> rows;  // rows per slice
};

// Builds the split graph of `graph` (the GraphDef `table` was built from) in
// `out`. `order` is a topological order of the table (ExecutorOrder). Fails,
// leaving `out` unspecified, if the region is not splittable as given (a region
// op reads a region tensor whole, a reduction feeds a region op, a preserved op).
absl::Status BuildSplitGraph(const tensorflow::GraphDef& graph, const TensorTable& table,
                             const std::vector<int>& order, const BatchAnalysis& batch,
                             const SplitSpec& spec, tensorflow::GraphDef* out,
                             SplitSummary* summary);

// Slices start at multiples of this many rows: the smallest number whose bytes are
// a multiple of 64 in every floating-point tensor the region cuts or makes.
// Element-wise kernels compute the vectorized body and the scalar tail of a buffer
// differently (exp, tanh, sigmoid, ... differ in the last bit): aligned, each
// element sits at the same place in its vector as in the whole tensor, and
// per-sample outputs stay bitwise equal. (Integer and boolean kernels are exact
// either way. A cut of rank 2 or more is a view whenever its rows are 64-byte
// multiples, wherever it starts.)
int64_t SliceUnit(const TensorTable& table, const BatchAnalysis& batch,
                  const std::vector<int>& region);

// Rows of each of `slices` slices of a batch of `batch`, starting at multiples of
// `unit` rows (the remainder of batch / unit goes to the last slice), as even as
// that allows; empty if the batch has fewer than `slices` units.
std::vector<int64_t> SliceRows(int64_t batch, int slices, int64_t unit = 1);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_SPLIT_PASS_H_
