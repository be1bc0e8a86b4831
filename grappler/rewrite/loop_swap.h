// Rewrite: swapping a loop's accumulators (recurrent networks).
//
// In a training step, a forward while-loop pushes the values its gradient needs
// into TensorLists (control flow v2's accumulators: one element per iteration), and
// the gradient loop pops them back in reverse. Those lists are a recurrent model's
// largest tensors ([steps, batch, units] each) and they stay on the device from the
// forward loop to the end of the gradient loop. The rewrite moves every element to
// host memory as it is pushed and brings it back as the gradient loop pops it:
//
//   forward body:   PushBack(list, item)  ->  PushBack(list, SwapOut(item))
//   gradient body:  readers of PopBack(list):1  ->  readers of SwapIn(PopBack(list):1)
//
// The list then holds host tensors only; the device holds the element being
// pushed or read. Values, iteration order and the loops' structure are unchanged:
// the copies are bitwise. Mechanism, by device (as lms_swap_optimizer.h):
// TfMemSwapOut / TfMemSwapIn on the CPU test bed (the host pool); on a GPU, an
// Identity on the host CPU for the swap-out and one on the GPU for the swap-in (TF
// inserts the copies).
//
// Prefetch: a gradient loop runs its iterations' list pops up to
// parallel_iterations ahead of its compute (they depend only on the list), so
// unbounded swap-ins could hold that many elements per list on the device. Each
// swap-in therefore waits (a control edge) for an Identity of the loop's earliest
// carried gradient, the value the previous iteration produces first: the copies of
// iteration i start while iteration i-1 finishes its other work, and about one
// iteration's elements are on the device at a time.
//
// A list is swappable (LoopSwapBlocker) when it is filled by a loop outside any
// other loop, its elements are read back only by TensorListPopBack (other readers
// only ask for its length or element shape, or pass it along), its items are new
// tensors of a plain type (not references to variables), its size is known, and no
// AddN of three or more inputs reads an item or a popped element (which buffer such
// an AddN sums into decides its last bits, and a copy changes which buffers are
// free to take).
#ifndef TFMEMOPT_GRAPPLER_REWRITE_LOOP_SWAP_H_
#define TFMEMOPT_GRAPPLER_REWRITE_LOOP_SWAP_H_

#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/rewrite/recompute_pass.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

inline constexpr char kLoopSwapOutScope[] = "TfMemOpt/LoopSwapOut/";
inline constexpr char kLoopSwapInScope[] = "TfMemOpt/LoopSwapIn/";

struct LoopSwapRewrite {
  LoopSwapRewrite() = default;
  LoopSwapRewrite(LoopSwapRewrite&&) = default;
  LoopSwapRewrite& operator=(LoopSwapRewrite&&) = default;
  LoopSwapRewrite(const LoopSwapRewrite&) = delete;
  LoopSwapRewrite& operator=(const LoopSwapRewrite&) = delete;

  // The input table with the swap nodes appended and readers rewired.
  TensorTable table;
  std::vector<int> order;
  std::deque<tensorflow::NodeDef> new_defs;  // table nodes point here
  struct Rewire {
    int node;  // reader, index in the input table (and graph)
    int slot;
    std::string input;
    std::string node_name;
  };
  std::vector<Rewire> rewires;
  std::vector<int> swapped;  // LoopAnalysis::lists indices, in order
  int num_swap_out = 0;      // nodes added (each runs once per iteration)
  int num_swap_in = 0;
  int64_t bytes_to_host = 0;  // per step: the lists' full sizes
  double copy_seconds = 0;    // predicted, both directions, per step
};

// Whether `node` is one of the loop swap's nodes (they run inside loop frames: a
// control edge to or from one would cross a frame).
inline bool IsLoopSwapNode(const tensorflow::NodeDef& node) {
  return absl::StartsWith(node.name(), kLoopSwapOutScope) ||
         absl::StartsWith(node.name(), kLoopSwapInScope);
}

// Why list `list` (LoopAnalysis::lists index) cannot be swapped, or "".
std::string LoopSwapBlocker(const TensorTable& table, int list);

// Bytes of the elements list `list` holds at its fullest: capacity x item bytes (0
// if unknown, or if the items are variable reads). For items read from another
// list, these are that list's bytes, which the list keeps alive.
int64_t LoopListBytes(const TensorTable& table, int list);

// Builds the rewrite that swaps `lists` (indices into table.loops.lists), on a
// table that may already hold other rewrites. Lists with a blocker are skipped.
// The table is taken over (moved).
absl::Status BuildLoopSwapRewrite(TensorTable&& table, const std::vector<int>& order,
                                  const std::vector<int>& lists,
                                  double bandwidth_bytes_per_sec, LoopSwapRewrite* rewrite);

// The same, applied to `table` in place; `edit` records how to take it back.
absl::Status LoopSwapInPlace(TensorTable* table, const std::vector<int>& order,
                             const std::vector<int>& lists, double bandwidth_bytes_per_sec,
                             LoopSwapRewrite* rewrite, TableEdit* edit);

// Applies `rewrite` to `graph`, whose nodes are the input table's nodes in order.
absl::Status ApplyLoopSwapRewrite(const LoopSwapRewrite& rewrite, tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_LOOP_SWAP_H_
