// Plan: the shape every memory mechanism has, so that the search over plans
// (plan/descent.h: the greedy descent and the exact search) is one piece of code
// that knows no mechanism.
//
// A mechanism is one way of taking a tensor off the device between its forward
// and its backward use: recompute it (plan/recompute_choice.h), swap it to host
// memory (plan/swap_choice.h), or swap what a loop accumulates for its gradient
// (plan/loop_swap_choice.h). Each one
//  * applies a list of items (its choice: nodes to recompute, tensors to swap) to
//    the planner's working table in place, and takes them back (Apply / Undo), so
//    that the planner simulates exactly the graph the rewrite stage would build;
//  * proposes candidates at the simulated peak: for a buffer that is live there
//    only because backward readers will read it later (a Holding), at most one
//    Candidate with the bytes it saves and the time it adds (Propose), and
//    candidates of its own that are no holding's (ProposeAtPeak);
//  * says what its items cost (ItemSeconds, AddSeconds), how many more it may take
//    (Room), whether it has an alternative placement worth simulating
//    (HasVariant), and which of its items an exact search should enumerate
//    (ExactItems, ExactFilter).
// The planner applies the mechanisms in their list order (each on top of the
// previous one's table and order), takes candidates by bytes saved per second
// added, and simulates every plan it considers.
//
// Mechanisms that change the graph's structure rather than one tensor's life
// (splitting work along the batch, plan/split_choice.h) cannot be applied in place
// on a table whose node indices the other mechanisms' choices refer to: they
// rewrite the graph, which is analyzed afresh, and the planner runs on the result
// (see PlanMemory).
#ifndef TFMEMOPT_GRAPPLER_PLAN_MECHANISM_H_
#define TFMEMOPT_GRAPPLER_PLAN_MECHANISM_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "grappler/plan/planner_options.h"

namespace tfmemopt {

// What every mechanism needs to know about the base table, computed once.
struct PlanContext {
  PlanContext(const TensorTable& table, const std::vector<int>& order,
              const ControlFlowInfo& flow, const MemoryPlannerOptions& options);

  const TensorTable& table;
  const std::vector<int>& order;  // the base table's simulated order
  const ControlFlowInfo& flow;
  const MemoryPlannerOptions& options;
  // Base tensors by buffer (forwarding ops put several tensors on one buffer).
  std::vector<std::vector<int>> tensors_of_buffer;
  // Per buffer: an input of an AddN of three or more inputs. TF's AddN sums into
  // the first input buffer it may reuse (one whose last reader it is) and moves
  // that input to the front: which buffers are reusable decides the order of the
  // sum, and so its last bits. A plan must not change that: an AddN's input is
  // never recomputed or swapped (its late readers would move to the copy), and no
  // clone keeps one alive that had no reader after the AddN.
  std::vector<bool> pinned;

  // Whether an output of `node` is pinned.
  bool FeedsAddN(int node) const;
  // Whether a clone of `node` reading its original inputs would keep an AddN
  // input alive past the AddN, which today frees (or reuses) it.
  bool ReadsAddNInputEarly(int node) const;
};

// A plan as the planner searches it: per mechanism (in the planner's list order),
// the items it applies.
struct Choice {
  std::vector<std::vector<int>> items;
  // Every mechanism applies its alternative placement (Mechanism::HasVariant);
  // the planner simulates both and keeps the better.
  bool variant = false;
  // Every mechanism places what it adds where it is needed (ApplyPinned), and the
  // planner pins the executor to the resulting order with control edges
  // (plan/pin_order.h), so that it runs exactly the order simulated.
  bool pinned = false;
  // With `pinned`: a base node; backward readers that run before it keep reading
  // the originals, later ones read the clones (clone_readers_from of
  // BuildRecomputeRewrite). -1: every backward reader reads the clones.
  int clone_readers_from = -1;
};

// A forward buffer live at the simulated peak only because readers in the
// backward pass (or the clones and swap-ins that serve them) read it later: what a
// mechanism may take off the device.
struct Holding {
  int buffer = -1;      // base buffer index
  int owner_node = -1;  // the base node that allocated it
  std::vector<int> late_tensors;  // base tensors on it that late readers read
  // owner_node, then the other producers of late tensors (forwarding ops).
  std::vector<int> producers;
};

// The simulated state a mechanism proposes against.
struct PeakView {
  const TensorTable& now;  // the working table with the current choice applied
  // Per node of `now`: its step in the simulated order (-1: not in it).
  const std::vector<int>& position;
  const std::vector<bool>& live;  // per buffer of `now`: live at the peak
};

struct Candidate {
  int mechanism = 0;       // index in the planner's list
  std::vector<int> items;  // what the mechanism applies if taken
  // Base nodes the candidate takes, and base nodes whose outputs its gain
  // assumes stay: a batch of candidates simulated together never takes a node
  // twice, nor one that another member anchors.
  std::vector<int> nodes;
  std::vector<int> anchors;
  int64_t gain = 0;     // bytes it takes off the peak (estimate)
  double seconds = 0;   // time it adds (estimate, > 0)
  int owner = 0;        // tie-break: the holding's owner node
  int buffer = -1;      // the holding's buffer (set by the planner)
};

class Mechanism {
 public:
  virtual ~Mechanism() = default;
  virtual const char* name() const = 0;

  // Applies `items` (sorted, unique) to `work` in place, after the previous
  // mechanisms, along `order` (their order of `work`). variant: the alternative
  // placement. Undo() takes back the last Apply (also a failed one).
  virtual absl::Status Apply(TensorTable* work, const std::vector<int>& order,
                             const std::vector<int>& items, bool variant) = 0;
  virtual void Undo(TensorTable* work) = 0;
  // Apply for an order the planner will pin (Choice::pinned): what the mechanism
  // adds goes where it is needed, since the executor will run it exactly there.
  // readers_from: Choice::clone_readers_from.
  virtual absl::Status ApplyPinned(TensorTable* work, const std::vector<int>& order,
                                   const std::vector<int>& items, int readers_from) {
    return Apply(work, order, items, /*variant=*/false);
  }
  // After Apply: the order of `work` for the next mechanism, the items really
  // applied (some may turn out to have nothing to act on), and `seconds` plus the
  // predicted time they add (added in the mechanism's own order, so that a sum
  // over mechanisms is the same number whoever computes it).
  virtual const std::vector<int>& order() const = 0;
  virtual const std::vector<int>& applied() const = 0;
  virtual double AddSeconds(double seconds) const = 0;

  // Proposals. BeginProposals gives the current choice's items of this mechanism;
  // then, per holding: Covers(buffer) if this mechanism already takes the buffer
  // (it is no holding then), and Propose adds at most one candidate.
  virtual void BeginProposals(const std::vector<int>& items) {}
  virtual bool Covers(int buffer) const { return false; }
  // Whether a node this mechanism added (past the base table) reads a tensor
  // early (in the forward pass) although it is marked backward.
  virtual bool EarlyReader(const NodeInfo& added) const { return false; }
  virtual void Propose(const PeakView& view, const Holding& holding, int self,
                       std::vector<Candidate>* out) = 0;
  // Candidates that are not one holding's (a loop's accumulators fill step by step
  // inside the loop: plan/loop_swap_choice.h), proposed once per simulated peak,
  // before the holdings' and after BeginProposals.
  virtual void ProposeAtPeak(const PeakView& view, int self, std::vector<Candidate>* out) {}

  // How many more items a choice holding `items` may take (INT64_MAX: no limit).
  virtual int64_t Room(const std::vector<int>& items) const { return INT64_MAX; }
  // Whether Apply(..., variant=true) may place `items` differently.
  virtual bool HasVariant(const std::vector<int>& items) const { return false; }
  // Whether the final cleanup may give back single items of one candidate.
  virtual bool Divisible() const { return false; }
  // Predicted time one item adds alone.
  virtual double ItemSeconds(int item) const = 0;

  // Exact search: the items to enumerate sets of. Returns false if there are
  // more than `limit` (the search is then not run).
  virtual bool ExactItems(int limit, std::vector<int>* items) {
    items->clear();
    return true;
  }
  // Given the search's items (mechanism, item) in bit order, a test of whether a
  // set (bit mask) can differ from a cheaper one in what this mechanism does;
  // sets that cannot are not simulated. Bits of other mechanisms are ignored.
  virtual std::function<bool(uint64_t)> ExactFilter(
      const std::vector<std::pair<int, int>>& items, int self) const {
    return [](uint64_t) { return true; };
  }
};

// Shared by the mechanisms' filters.
// Bytes of a value whose contents are plain memory; the rest (handles, variants,
// strings) cannot be cloned or copied by value safely.
bool PlainType(tensorflow::DataType dtype);
bool MatchesAnyScope(const std::string& name, const std::vector<std::string>& scopes);
// Whether the user's include/exclude lists let the planner touch `def`; "" if so,
// else "excluded" or "not_included".
std::string FilterReason(const tensorflow::NodeDef& def, const MemoryPlannerOptions& options);
// True if `name` is in `scope` (equal to it, or under it: "scope/...").
bool InScope(const std::string& name, const std::string& scope);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_PLAN_MECHANISM_H_
