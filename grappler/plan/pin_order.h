// Plan: pins TF's executor to an order with control edges, so that what a plan adds
// (a recomputation's clone, a swap's copies) runs where the plan placed it.
//
// Without them, TF's executor runs a node as soon as it is ready, by its own rules
// (emulated by ExecutorOrder): a clone triggered by its reader's last gradient
// input can run well before the reader, past other large steps, and hold its output
// there; the nodes around it can move too. A plan costed on "each clone runs right
// before its reader, everything else as before" (Checkmate's model, and the
// cheapest placement for memory) is only what runs if the order is enforced, as the
// scheduling stage (plan/schedule.h) enforces its own edges.
//
// Edges are found one at a time: the first step where the emulated executor order
// differs from the target, the node it runs there too early waits for the target's
// node. The target is a topological order of the graph with every edge added, so no
// edge closes a cycle. Nodes under control flow (a control edge cannot cross a
// frame; the loop swap's copies included) and inputs are never made to wait, and no edge is added from a node that
// the waiting node runs before (in graphs with loops the emulated executor order
// need not follow every path); the pinning then stops, incomplete.
#ifndef TFMEMOPT_GRAPPLER_PLAN_PIN_ORDER_H_
#define TFMEMOPT_GRAPPLER_PLAN_PIN_ORDER_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/rewrite/recompute_pass.h"
#include "grappler/simulate/liveness_simulator.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

// Nodes whose place in the order changes nothing a plan is about: constants. A
// Const's buffer is held by its kernel for the whole step (IsPersistentProducer in
// analyze/tensor_table.cc), so where it runs moves no bytes; only its readers'
// places matter, and those are pinned where they leave the target. Pinning never
// adds a control edge into or out of a Const: TF's constant folding moves a
// Const's control inputs onto the nodes it folds or pushes the Const into, and its
// guard against the cycles that can close (ConstantFolding::PrepareConstantPushDown,
// TF 2.21) sees only a direct control edge from the other operand to the Const. With
// P = Mul(C, M), M = Mul(c, X) and C waiting for a node that waits for M, the
// push-down rewrites M to Mul(C, c), which then waits for itself; TF's dependency
// optimizer creates exactly that shape when it drops M -> C as implied by
// M -> (our node) -> C (stress split seed 167, its second meta-optimizer run).
bool IsUntimed(const tensorflow::NodeDef& def);

// Whether node `n` may be made to wait for another node by a control edge (not
// under control flow, not an input of the graph, not untimed), and whether another
// node may wait for `n` (not under control flow: a control edge cannot cross a
// frame; not untimed; not a return value, IsReturnValue). The loop swap's copies,
// added inside loop frames, are under control flow too.
bool MayWait(const TensorTable& table, const ControlFlowInfo& flow, int n);
bool MayBeWaitedFor(const TensorTable& table, const ControlFlowInfo& flow, int n);

struct PinnedOrder {
  // Control edges added to the table, as (from, to) node indices: `to` waits for
  // `from`.
  std::vector<std::pair<int, int>> edges;
  // The executor order of the table with the edges equals the target.
  bool complete = false;
};

// Adds control edges to `table` (recorded in `edit` when given, to take back)
// until ExecutorOrder(*table, choice) is `target` for every choice in `choices`, or
// `max_edges` are added, or a node that may not wait would have to. Orders are
// compared without their untimed nodes (IsUntimed), which neither wait nor are
// waited for. `order` receives the table's executor order with the edges added, by
// the first choice.
absl::Status PinOrder(TensorTable* table, const ControlFlowInfo& flow,
                      const std::vector<int>& target, int max_edges, TableEdit* edit,
                      PinnedOrder* pinned, std::vector<int>* order,
                      const std::vector<InlineChoice>& choices = {InlineChoice::kNearestUpdate});

// How many edges a plan that added `added` nodes may pin its order with.
inline int PinEdgeLimit(int added) { return 16 + 4 * added; }

// The edges as (from, to) node names, to add to a GraphDef.
std::vector<std::pair<std::string, std::string>> PinnedEdgeNames(const TensorTable& table,
                                                                 const PinnedOrder& pinned);

// Adds named control edges (to waits for from) to `graph`.
absl::Status ApplyPinnedEdges(const std::vector<std::pair<std::string, std::string>>& edges,
                              tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_PIN_ORDER_H_
