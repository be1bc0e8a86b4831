// Rewrite: recomputation. Forward nodes chosen by the planner get a clone, named
// TfMemOpt/Recompute/<original name>, that backward consumers read instead of the
// original output, so the original buffer is freed after its last forward use.
//
// A clone reads the clones of its recomputed inputs and the original tensors of
// everything else (the checkpoints). A control edge from a gradient-side input of
// the clone's earliest backward consumer (the trigger) keeps the executor from
// running the clone during the forward pass, which would save nothing.
//
// The same RecomputeRewrite drives the planner's simulation (its table and order)
// and the GraphDef edit, so what is simulated is what is run.
#ifndef TFMEMOPT_GRAPPLER_REWRITE_RECOMPUTE_PASS_H_
#define TFMEMOPT_GRAPPLER_REWRITE_RECOMPUTE_PASS_H_

#include <deque>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

inline constexpr char kTfMemOptScope[] = "TfMemOpt/";
inline constexpr char kRecomputeScope[] = "TfMemOpt/Recompute/";

struct RecomputeRewrite {
  RecomputeRewrite() = default;
  // Moves keep the clones' addresses (table.nodes point into clone_defs); copies
  // would not.
  RecomputeRewrite(RecomputeRewrite&&) = default;
  RecomputeRewrite& operator=(RecomputeRewrite&&) = default;
  RecomputeRewrite(const RecomputeRewrite&) = delete;
  RecomputeRewrite& operator=(const RecomputeRewrite&) = delete;

  // The base table with one node per clone appended (base indices unchanged),
  // consumers rewired to the clones.
  TensorTable table;
  // The base order with each clone just before its earliest backward consumer.
  std::vector<int> order;
  // NodeDefs of the clones; table.nodes of clones point into it (stable addresses).
  std::deque<tensorflow::NodeDef> clone_defs;
  struct Rewire {
    int node;   // consumer, base node index
    int slot;   // data input index
    std::string input;  // the clone's tensor name
    std::string node_name;  // the consumer's name, to check the graph against
  };
  std::vector<Rewire> rewires;
  std::vector<int> cloned;  // base node indices that got a clone, in base order
  int num_triggers = 0;
  double added_seconds = 0;  // predicted compute time of all clones
};

// What an in-place rewrite changed in a table, to take it back: the sizes the
// tables had, and the old consumer lists and node inputs it overwrote, in order.
struct TableEdit {
  size_t nodes = 0, tensors = 0, buffers = 0;
  std::vector<std::pair<int, std::vector<int>>> consumers;  // tensor, old list
  std::vector<std::tuple<int, int, int>> inputs;            // node, slot, old tensor
  std::vector<std::pair<int, size_t>> control_inputs;       // node, old count
  std::vector<std::pair<int, BufferInfo>> buffer_fields;    // buffer, old fields
  std::vector<std::pair<int, int64_t>> temp_bytes;          // node, old temp_bytes

  void Begin(const TensorTable& table);
  void SaveConsumers(const TensorTable& table, int tensor) {
    consumers.emplace_back(tensor, table.tensors[tensor].consumers);
  }
  void SaveInput(const TensorTable& table, int node, int slot) {
    inputs.emplace_back(node, slot, table.nodes[node].inputs[slot]);
  }
  // Before control inputs are appended to `node`.
  void SaveControlInputs(const TensorTable& table, int node) {
    control_inputs.emplace_back(node, table.nodes[node].control_inputs.size());
  }
  // Before a buffer of the table's is changed in place.
  void SaveBuffer(const TensorTable& table, int buffer) {
    buffer_fields.emplace_back(buffer, table.buffers[buffer]);
  }
  // Before a node's temp_bytes is changed.
  void SaveTempBytes(const TensorTable& table, int node) {
    temp_bytes.emplace_back(node, table.nodes[node].temp_bytes);
  }
  // Restores `table` to what it was at Begin().
  void Undo(TensorTable* table) const;
};

// A consumer reads recomputed values only if it is a backward node that also
// depends directly on a backward node (a gradient input, or a control edge from
// one): then it cannot run before the forward pass is over, and neither can a
// clone triggered by that node. Other consumers keep the original (it is needed
// early anyway).
bool ReadsRecomputedValues(const TensorTable& table, const ControlFlowInfo& flow,
                           int consumer);

// With the order pinned (ClonePlacement::kBeforeReader), every backward consumer
// outside control flow reads recomputed values: the pinned order keeps it where it
// was, after the forward pass, even one that reads only forward values (a
// gradient's forward-looking factor, such as 2 * (x - y) of a squared error).
bool ReadsClonesWhenPinned(const TensorTable& table, const ControlFlowInfo& flow,
                           int consumer);

// The backward node among `consumer`'s direct data and control inputs that runs
// last (by `position`, or the first found without one), or -1.
int LatestBackwardInput(const TensorTable& table, const ControlFlowInfo& flow, int consumer,
                        const std::vector<int>* position = nullptr);

// Which backward node a clone's trigger edge comes from, i.e. when the executor may
// run the clone. Which placement lowers the peak depends on the graph; the planner
// simulates them (plan/descent.cc, Evaluate).
enum class ClonePlacement {
  // The latest gradient-side input of the clone's earliest backward reader.
  kAtReaderInput,
  // That trigger's own latest backward input, where there is one: the executor can
  // run the clone beside the reader's last gradient input instead of behind that
  // input's other consumers.
  kEarlier,
  // The backward node that runs right before the reader in `order`: the clone runs
  // just before its reader, where recomputation frees the most (Checkmate's
  // placement). With the order pinned (plan/pin_order.h), the executor runs it
  // exactly there.
  kBeforeReader,
};

// Builds the rewrite for recomputing `nodes` (base node indices; forward, stateless,
// outside control flow: the planner's job). Nodes whose clone nobody would read
// are skipped.
//
// clone_readers_from (a base node, or -1): with kBeforeReader, backward readers that
// `order` runs before this node keep reading the original, and only the later ones
// read the clone. Where the peak falls between a tensor's backward readers (a
// weight gradient early in the backward pass, the activation gradient late), the
// original is then freed before the peak and the clone made after it, as Checkmate
// recomputes a value only in the stages after the peak; a clone serving every
// backward reader would be live across the peak instead.
absl::Status BuildRecomputeRewrite(const TensorTable& base, const std::vector<int>& order,
                                   const ControlFlowInfo& flow,
                                   const std::vector<int>& nodes, RecomputeRewrite* rewrite,
                                   ClonePlacement placement = ClonePlacement::kAtReaderInput,
                                   int clone_readers_from = -1);

// The same, applied to `table` in place (rewrite->table stays empty); `edit`
// records how to take it back. The planner simulates candidate plans this way.
absl::Status RecomputeInPlace(TensorTable* table, const std::vector<int>& order,
                              const ControlFlowInfo& flow, const std::vector<int>& nodes,
                              RecomputeRewrite* rewrite, TableEdit* edit,
                              ClonePlacement placement = ClonePlacement::kAtReaderInput,
                              int clone_readers_from = -1);

// Applies `rewrite` to `graph`, the GraphDef the base table was built from.
absl::Status ApplyRecomputeRewrite(const RecomputeRewrite& rewrite,
                                   tensorflow::GraphDef* graph);

// True if `graph` already holds nodes that tfmemopt added (a later meta-optimizer
// iteration over our own output).
bool HasTfMemOptNodes(const tensorflow::GraphDef& graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_RECOMPUTE_PASS_H_
