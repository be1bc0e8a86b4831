#include "grappler/analyze/loops.h"

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils/frame.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// Chains of value-forwarding ops are short; this only bounds a walk on a
// malformed graph.
constexpr int kMaxHops = 64;

bool IsListCreatorOp(const NodeDef& node) {
  return node.op() == "EmptyTensorList" || node.op() == "TensorListReserve";
}

// Integer scalar of a Const node.
std::optional<int64_t> ConstScalar(const NodeDef& node) {
  if (node.op() != "Const" || !node.attr().count("value")) return std::nullopt;
  tensorflow::Tensor tensor;
  if (!tensor.FromProto(node.attr().at("value").tensor()) || tensor.NumElements() != 1) {
    return std::nullopt;
  }
  if (tensor.dtype() == tensorflow::DT_INT32) return tensor.flat<int32_t>()(0);
  if (tensor.dtype() == tensorflow::DT_INT64) return tensor.flat<int64_t>()(0);
  return std::nullopt;
}

// Integer values the condition of a lowered loop is made of, evaluated without
// running anything: constants, values carried unchanged through a loop, and the
// final value of a counter whose loop's trip count is known.
class Evaluator {
 public:
  Evaluator(const TensorTable& table, const std::vector<int>& loop_of_node,
            std::vector<LoopFrame>* loops)
      : table_(table), loop_of_node_(loop_of_node), loops_(loops) {}

  // The node producing tensor `t`, seen through Identity / Enter / Switch (which
  // forward their data input unchanged).
  int Source(int t, int* port) const {
    for (int hops = 0; hops < kMaxHops; ++hops) {
      const TensorInfo& tensor = table_.tensors[t];
      const NodeDef& def = *table_.nodes[tensor.node].def;
      const std::string& op = def.op();
      const bool pass = op == "Identity" || op == "Snapshot" || op == "Enter" ||
                        op == "Switch" || op == "StopGradient";
      if (!pass || table_.nodes[tensor.node].inputs.empty()) {
        *port = tensor.port;
        return tensor.node;
      }
      t = table_.nodes[tensor.node].inputs[0];
    }
    *port = -1;
    return -1;
  }

  // The loop-variable Merge whose value `t` is, or -1.
  int MergeOf(int t) const {
    int port = 0;
    const int n = Source(t, &port);
    return n >= 0 && tensorflow::grappler::IsMerge(*table_.nodes[n].def) && port == 0 ? n : -1;
  }

  // Inputs of a loop Merge: the value entering the loop, the value of the next
  // iteration (through NextIteration's input). False if not a loop Merge.
  bool MergeInputs(int merge, int* initial, int* next) const {
    *initial = *next = -1;
    for (int t : table_.nodes[merge].inputs) {
      const int producer = table_.tensors[t].node;
      if (tensorflow::grappler::IsNextIteration(*table_.nodes[producer].def)) {
        if (table_.nodes[producer].inputs.empty()) return false;
        *next = table_.nodes[producer].inputs[0];
      } else {
        *initial = t;
      }
    }
    return *initial >= 0 && *next >= 0;
  }

  // A counter: initial value a constant, next = counter + constant step.
  bool Counter(int merge, int64_t* start, int64_t* step) {
    int initial = -1, next = -1;
    if (!MergeInputs(merge, &initial, &next)) return false;
    const std::optional<int64_t> begin = Value(initial);
    if (!begin) return false;
    const NodeInfo& add = table_.nodes[table_.tensors[next].node];
    const std::string& op = add.def->op();
    if ((op != "AddV2" && op != "Add") || add.inputs.size() != 2) return false;
    for (int i = 0; i < 2; ++i) {
      if (MergeOf(add.inputs[i]) != merge) continue;
      const std::optional<int64_t> increment = Value(add.inputs[1 - i]);
      if (!increment) return false;
      *start = *begin;
      *step = *increment;
      return true;
    }
    return false;
  }

  std::optional<int64_t> Value(int t) {
    if (++depth_ > kMaxHops) {
      --depth_;
      return std::nullopt;
    }
    std::optional<int64_t> result = ValueOf(t);
    --depth_;
    return result;
  }

  // Trip count of loop `l` from its LoopCond's input, or -1.
  int64_t TripCount(int l) {
    const LoopFrame& loop = (*loops_)[l];
    if (loop.loop_cond < 0 || table_.nodes[loop.loop_cond].inputs.empty()) return -1;
    return Bound(table_.nodes[loop.loop_cond].inputs[0]);
  }

 private:
  std::optional<int64_t> ValueOf(int t) {
    int port = 0;
    const int n = Source(t, &port);
    if (n < 0) return std::nullopt;
    const NodeDef& def = *table_.nodes[n].def;
    if (tensorflow::grappler::IsConstant(def)) return ConstScalar(def);
    if (tensorflow::grappler::IsMerge(def)) {
      // Carried unchanged: the next iteration's value is this Merge's own.
      int initial = -1, next = -1;
      if (!MergeInputs(n, &initial, &next) || MergeOf(next) != n) return std::nullopt;
      return Value(initial);
    }
    if (tensorflow::grappler::IsExit(def) && !table_.nodes[n].inputs.empty()) {
      // A loop's final value: unchanged, or a counter after trip_count steps.
      const int merge = MergeOf(table_.nodes[n].inputs[0]);
      if (merge < 0) return std::nullopt;
      int initial = -1, next = -1;
      if (!MergeInputs(merge, &initial, &next)) return std::nullopt;
      if (MergeOf(next) == merge) return Value(initial);
      int64_t start = 0, step = 0;
      if (!Counter(merge, &start, &step)) return std::nullopt;
      const int loop = loop_of_node_[merge];
      if (loop < 0) return std::nullopt;
      const int64_t trips = TripCountOf(loop);
      if (trips < 0) return std::nullopt;
      return start + trips * step;
    }
    return std::nullopt;
  }

  int64_t TripCountOf(int l) {
    LoopFrame& loop = (*loops_)[l];
    if (loop.trip_count >= 0 || visiting_.count(l)) return loop.trip_count;
    visiting_[l] = true;
    const int64_t trips = TripCount(l);
    visiting_.erase(l);
    if (trips >= 0) {
      loop.trip_count = trips;
      loop.trip_count_source = "condition";
    }
    return trips;
  }

  // An upper bound on the iterations for which boolean `t` holds, or -1.
  int64_t Bound(int t) {
    int port = 0;
    const int n = Source(t, &port);
    if (n < 0) return -1;
    const NodeInfo& node = table_.nodes[n];
    const std::string& op = node.def->op();
    if (op == "LogicalAnd" && node.inputs.size() == 2) {
      const int64_t a = Bound(node.inputs[0]), b = Bound(node.inputs[1]);
      if (a < 0) return b;
      if (b < 0) return a;
      return std::min(a, b);
    }
    if ((op == "Less" || op == "LessEqual" || op == "Greater" || op == "GreaterEqual") &&
        node.inputs.size() == 2) {
      // counter < limit (or limit > counter).
      const bool counter_first = op == "Less" || op == "LessEqual";
      const int counter = MergeOf(node.inputs[counter_first ? 0 : 1]);
      if (counter < 0) return -1;
      int64_t start = 0, step = 0;
      if (!Counter(counter, &start, &step) || step <= 0) return -1;
      const std::optional<int64_t> limit = Value(node.inputs[counter_first ? 1 : 0]);
      if (!limit) return -1;
      const bool inclusive = op == "LessEqual" || op == "GreaterEqual";
      const int64_t span = *limit - start + (inclusive ? 1 : 0);
      return span <= 0 ? 0 : (span + step - 1) / step;
    }
    return -1;
  }

  const TensorTable& table_;
  const std::vector<int>& loop_of_node_;
  std::vector<LoopFrame>* loops_;
  absl::flat_hash_map<int, bool> visiting_;
  int depth_ = 0;
};

// Follows `tensor` back through ops that forward their input's buffer. True if
// the chain passes a Merge (a loop-carried value: a new tensor in every
// iteration); sets *from_list if it starts at an element taken from a TensorList
// (which shares the list's storage).
bool LoopCarried(const TensorTable& table, int tensor, bool* from_list) {
  *from_list = false;
  for (size_t hops = 0; hops < table.tensors.size(); ++hops) {
    const TensorInfo& t = table.tensors[tensor];
    const NodeInfo& producer = table.nodes[t.node];
    const std::string& op = producer.def->op();
    if (op == "Merge" || op == "RefMerge") return true;
    if (op == "TensorListGetItem" || (op == "TensorListPopBack" && t.port == 1)) {
      *from_list = true;
      return false;
    }
    const int source = ForwardedInput(*producer.def, t.port);
    if (source < 0 || source >= static_cast<int>(producer.inputs.size())) return false;
    tensor = producer.inputs[source];
  }
  return false;
}

}  // namespace

bool IsListWrite(const NodeDef& node, int* item_port) {
  if (node.op() == "TensorListPushBack") {
    *item_port = 1;
    return true;
  }
  if (node.op() == "TensorListSetItem") {
    *item_port = 2;
    return true;
  }
  return false;
}

absl::Status AnalyzeLoops(const tensorflow::GraphDef& graph, const TensorTable& table,
                          int64_t assume_trip_count, LoopAnalysis* analysis) {
  *analysis = LoopAnalysis();
  const int n = static_cast<int>(table.nodes.size());
  analysis->loop_of_node.assign(n, -1);
  bool any_enter = false;
  for (const NodeInfo& node : table.nodes) any_enter |= tensorflow::grappler::IsEnter(*node.def);
  if (!any_enter) return absl::OkStatus();

  tensorflow::grappler::FrameView frames;
  absl::Status status = frames.InferFromGraph(graph);
  if (!status.ok()) return status;
  // Frame ids -> loops, in order of first appearance.
  absl::flat_hash_map<int, int> loop_of_frame;
  for (int i = 0; i < n; ++i) {
    const NodeDef& def = *table.nodes[i].def;
    const std::vector<int>& ids = frames.Frames(def);
    if (ids.empty()) continue;
    auto [it, added] = loop_of_frame.try_emplace(ids.back(), static_cast<int>(analysis->loops.size()));
    if (added) analysis->loops.emplace_back();
    LoopFrame& loop = analysis->loops[it->second];
    analysis->loop_of_node[i] = it->second;
    if (tensorflow::grappler::IsEnter(def)) {
      loop.enters.push_back(i);
      if (def.attr().count("frame_name")) loop.name = def.attr().at("frame_name").s();
      if (def.attr().count("parallel_iterations")) {
        loop.parallel_iterations =
            std::max<int>(1, static_cast<int>(def.attr().at("parallel_iterations").i()));
      }
    } else if (tensorflow::grappler::IsExit(def)) {
      loop.exits.push_back(i);
    } else if (tensorflow::grappler::IsLoopCond(def)) {
      loop.loop_cond = i;
    }
    if (table.nodes[i].backward && tensorflow::grappler::IsLoopCond(def)) loop.backward = true;
  }

  Evaluator evaluator(table, analysis->loop_of_node, &analysis->loops);
  for (size_t l = 0; l < analysis->loops.size(); ++l) {
    LoopFrame& loop = analysis->loops[l];
    if (loop.trip_count < 0) {
      const int64_t trips = evaluator.TripCount(static_cast<int>(l));
      if (trips >= 0) {
        loop.trip_count = trips;
        loop.trip_count_source = "condition";
      }
    }
  }
  for (LoopFrame& loop : analysis->loops) {
    if (loop.trip_count < 0 && assume_trip_count > 0) {
      loop.trip_count = assume_trip_count;
      loop.trip_count_source = "assume_trip_count";
    }
  }

  // List instances: an Enter whose input is a freshly created list.
  absl::flat_hash_map<int, int> list_of_buffer;
  for (int i = 0; i < n; ++i) {
    const NodeInfo& node = table.nodes[i];
    if (!tensorflow::grappler::IsEnter(*node.def) || node.inputs.empty() ||
        node.outputs.empty() || analysis->loop_of_node[i] < 0) {
      continue;
    }
    const int creator = table.tensors[node.inputs[0]].node;
    if (!IsListCreatorOp(*table.nodes[creator].def)) continue;
    ListInstance list;
    list.loop = analysis->loop_of_node[i];
    list.enter = i;
    list.creator = creator;
    list.buffer = table.tensors[node.outputs[0]].buffer;
    list_of_buffer[list.buffer] = static_cast<int>(analysis->lists.size());
    analysis->loops[list.loop].lists.push_back(static_cast<int>(analysis->lists.size()));
    analysis->lists.push_back(std::move(list));
  }
  for (int i = 0; i < n; ++i) {
    const NodeInfo& node = table.nodes[i];
    if (node.inputs.empty()) continue;
    auto it = list_of_buffer.find(table.tensors[node.inputs[0]].buffer);
    if (it == list_of_buffer.end()) continue;
    ListInstance& list = analysis->lists[it->second];
    int item_port = 0;
    if (IsListWrite(*node.def, &item_port) && static_cast<int>(node.inputs.size()) > item_port &&
        analysis->loop_of_node[i] == list.loop) {
      list.pushes.push_back(i);
      if (list.item < 0) list.item = node.inputs[item_port];
    } else if (node.def->op() == "TensorListPopBack") {
      list.pops.push_back(i);
    }
  }

  for (ListInstance& list : analysis->lists) {
    const NodeInfo& creator = table.nodes[list.creator];
    std::optional<int64_t> count;
    if (creator.inputs.size() >= 2) {
      count = ConstScalar(*table.nodes[table.tensors[creator.inputs[1]].node].def);
    }
    const bool reserve = creator.def->op() == "TensorListReserve";
    const LoopFrame& loop = analysis->loops[list.loop];
    if (reserve && count && *count >= 0) {
      list.capacity = *count;
      list.capacity_source = "num_elements";
    } else if (loop.trip_count >= 0 && !list.pushes.empty()) {
      // SetItem writes one slot per push; PushBack appends one element.
      list.capacity = reserve ? loop.trip_count
                              : loop.trip_count * static_cast<int64_t>(list.pushes.size());
      list.capacity_source = "trip_count";
      if (!reserve && count && *count >= 0 && *count < list.capacity) {
        list.capacity = *count;  // EmptyTensorList's max_num_elements caps it
        list.capacity_source = "max_num_elements";
      }
    } else if (!reserve && count && *count >= 0) {
      list.capacity = *count;
      list.capacity_source = "max_num_elements";
    }
    if (list.item >= 0) {
      bool from_list = false;
      const bool carried = LoopCarried(table, list.item, &from_list);
      list.referenced =
          from_list ||
          (!carried && table.buffers[table.tensors[list.item].buffer].persistent);
    }
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
