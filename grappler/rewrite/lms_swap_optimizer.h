// Rewrite: swapping (large model support). A forward tensor chosen by the planner
// is copied to host memory right after it is produced (swap-out) and copied back
// just before its first backward reader needs it (swap-in), so the device holds
// neither in between.
//
// Mechanism, by the tensor's device:
//  * CPU (the capped-allocator test bed): TfMemSwapOut / TfMemSwapIn
//    (grappler/ops/swap_ops.h); the stash lives in tfmemopt's host pool, outside
//    the device allocator.
//  * GPU: TFLMS's mechanism. The swap-out is an Identity placed on the host CPU and
//    the swap-in an Identity on the GPU, so TF inserts the device copies; both are
//    marked _grappler_do_not_remove so later Grappler passes keep them.
//
// The swap-in is held back by a control edge from a backward node (the trigger):
// walking back from the first reader along its gradient inputs until the ops
// passed would take as long as the copy (from OpLevelCostEstimator times and the
// copy bandwidth), so the copy overlaps that compute and ends about when the
// reader starts. swapin_lead_ops / swapin_lag_ops bound that distance in ops, as
// TFLMS's lb / ub did in topological levels.
//
// On the CPU the producer's forward readers wait for the swap-out (a control
// edge), so that the executor runs it at once whatever its thread count.
//
// Like RecomputeRewrite, a SwapRewrite carries the table and order the simulator
// sees, and the same object edits the GraphDef.
#ifndef TFMEMOPT_GRAPPLER_REWRITE_LMS_SWAP_OPTIMIZER_H_
#define TFMEMOPT_GRAPPLER_REWRITE_LMS_SWAP_OPTIMIZER_H_

#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/rewrite/recompute_pass.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

inline constexpr char kSwapOutScope[] = "TfMemOpt/SwapOut/";
inline constexpr char kSwapInScope[] = "TfMemOpt/SwapIn/";

struct SwapOptions {
  // Copy bandwidth between the device and host memory, bytes per second.
  double bandwidth_bytes_per_sec = 3.65e9;
  // Bounds on how many backward ops ahead of its first reader a swap-in starts;
  // 0: no bound (the copy time decides).
  int lead_ops = 0;
  int lag_ops = 0;
  // One swap-in feeds every backward reader (true), or one per reader.
  bool fuse_swapins = true;
};

struct SwapRewrite {
  SwapRewrite() = default;
  SwapRewrite(SwapRewrite&&) = default;
  SwapRewrite& operator=(SwapRewrite&&) = default;
  SwapRewrite(const SwapRewrite&) = delete;
  SwapRewrite& operator=(const SwapRewrite&) = delete;

  // The input table with the swap nodes appended, readers rewired.
  TensorTable table;
  // Swap-outs right after their tensor's producer, swap-ins right after their trigger.
  std::vector<int> order;
  std::deque<tensorflow::NodeDef> new_defs;  // table nodes point here
  struct Rewire {
    int node;  // reader, index in the input table (and graph)
    int slot;
    std::string input;
    std::string node_name;  // the reader's name, to check the graph against
  };
  std::vector<Rewire> rewires;
  // A forward reader of a swapped tensor's producer waits for the swap-out (a
  // control edge).
  struct Wait {
    int node;  // index in the input table (and graph)
    std::string swap_out;
    std::string node_name;
  };
  std::vector<Wait> waits;
  std::vector<int> swapped;  // input-table tensor indices, in order
  int num_swap_out = 0;
  int num_swap_in = 0;
  int64_t bytes_to_host = 0;
  double copy_seconds = 0;  // predicted copy time, both directions
};

// Readers of `tensor` that run in the backward pass and so can read a swapped-in
// copy: backward nodes that depend on a backward node (see ReadsRecomputedValues)
// and recomputation clones.
std::vector<int> LateReaders(const TensorTable& table, const ControlFlowInfo& flow, int tensor);

// Builds the rewrite that swaps `tensors` (indices into `table`, which may already
// hold recomputation clones). Tensors without late readers are skipped. The table
// is taken over (moved) to save a copy.
absl::Status BuildSwapRewrite(TensorTable&& table, const std::vector<int>& order,
                              const ControlFlowInfo& flow, const std::vector<int>& tensors,
                              const SwapOptions& options, SwapRewrite* rewrite);

// The same, applied to `table` in place (rewrite->table stays empty); `edit`
// records how to take it back.
absl::Status SwapInPlace(TensorTable* table, const std::vector<int>& order,
                         const ControlFlowInfo& flow, const std::vector<int>& tensors,
                         const SwapOptions& options, SwapRewrite* rewrite, TableEdit* edit);

// Applies `rewrite` to `graph`, whose nodes are the rewrite's input table's nodes in
// the same order.
absl::Status ApplySwapRewrite(const SwapRewrite& rewrite, tensorflow::GraphDef* graph);

// Host bytes held by swapped-out tensors at each step of `order` (its peak is what
// the host pool will hold).
std::vector<int64_t> HostBytesTimeline(const TensorTable& table, const std::vector<int>& order,
                                       int64_t* peak);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_LMS_SWAP_OPTIMIZER_H_
