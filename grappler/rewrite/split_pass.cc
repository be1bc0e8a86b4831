#include "grappler/rewrite/split_pass.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/tensor_id.h"

namespace tfmemopt {
namespace {

using tensorflow::DataType;
using tensorflow::NodeDef;

std::string TensorRef(const std::string& node, int port) {
  return port == 0 ? node : absl::StrCat(node, ":", port);
}

NodeDef IntVectorConst(const std::string& name, const std::string& device, DataType dtype,
                       const std::vector<int64_t>& values) {
  NodeDef node;
  node.set_name(name);
  node.set_op("Const");
  node.set_device(device);
  (*node.mutable_attr())["dtype"].set_type(dtype);
  tensorflow::TensorProto* value = (*node.mutable_attr())["value"].mutable_tensor();
  value->set_dtype(dtype);
  value->mutable_tensor_shape()->add_dim()->set_size(static_cast<int64_t>(values.size()));
  for (int64_t v : values) {
    if (dtype == tensorflow::DT_INT64) {
      value->add_int64_val(v);
    } else {
      value->add_int_val(static_cast<int32_t>(v));
    }
  }
  return node;
}

NodeDef IntScalarConst(const std::string& name, const std::string& device, DataType dtype,
                       int64_t v) {
  NodeDef node = IntVectorConst(name, device, dtype, {v});
  (*node.mutable_attr())["value"].mutable_tensor()->mutable_tensor_shape()->clear_dim();
  return node;
}

class SplitBuilder {
 public:
  SplitBuilder(const tensorflow::GraphDef& graph, const TensorTable& table,
               const std::vector<int>& order, const BatchAnalysis& batch, const SplitSpec& spec,
               tensorflow::GraphDef* out, SplitSummary* summary)
      : graph_(graph), table_(table), order_(order), batch_(batch), spec_(spec), out_(out),
        summary_(summary), k_(spec.slices) {}

  absl::Status Build() {
    const int n = static_cast<int>(table_.nodes.size());
    if (k_ < 2 || batch_.batch < k_) {
      return absl::InvalidArgumentError(
          absl::StrCat("split: ", k_, " slices of a batch of ", batch_.batch));
    }
    if (static_cast<int>(order_.size()) != n) {
      return absl::InvalidArgumentError("split: the order does not cover the graph");
    }
    *summary_ = SplitSummary();
    summary_->rows = SliceRows(batch_.batch, k_, SliceUnit(table_, batch_, spec_.nodes));
    if (summary_->rows.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "split: a batch of ", batch_.batch, " has fewer than ", k_, " aligned slices"));
    }
    rows_ = summary_->rows;
    in_region_.assign(n, false);
    for (int q : spec_.nodes) {
      if (q < 0 || q >= n || batch_.nodes[q].role == BatchRole::kNone) {
        return absl::InvalidArgumentError("split: a region node is not per-sample");
      }
      in_region_[q] = true;
    }
    region_.assign(spec_.nodes.begin(), spec_.nodes.end());
    std::sort(region_.begin(), region_.end());
    region_.erase(std::unique(region_.begin(), region_.end()), region_.end());
    summary_->region_nodes = static_cast<int>(region_.size());
    absl::Status status = Check();
    if (!status.ok()) return status;
    FindShapeReaders();
    FindStages();
    out_->CopyFrom(graph_);
    out_->clear_node();
    const int before = graph_.node_size();
    for (int v = 0; v < n; ++v) {
      if (in_region_[v] || replaced_[v]) continue;
      status = EmitOutside(v);
      if (!status.ok()) return status;
    }
    for (int q : region_) {
      for (int i = 0; i < k_; ++i) {
        status = EmitSlice(q, i);
        if (!status.ok()) return status;
      }
    }
    EmitCuts();
    EmitJoins();
    EmitBarriers();
    for (const NodeDef& node : extra_) *out_->add_node() = node;
    // TF's own passes, should they run on this output again (another
    // meta-optimizer trip), must keep the slices as they are: the dependency
    // optimizer would drop the barriers, the arithmetic optimizer would fold the
    // sums into an AddN (another order) and constant folding merge the cuts.
    for (tensorflow::NodeDef& node : *out_->mutable_node()) {
      if (absl::StartsWith(node.name(), kSplitScope)) {
        (*node.mutable_attr())["_grappler_do_not_remove"].set_b(true);
      }
    }
    summary_->added_nodes =
        out_->node_size() - (before - static_cast<int>(region_.size()) - num_replaced_);
    return absl::OkStatus();
  }

 private:
  const NodeInfo& node(int v) const { return table_.nodes[v]; }
  const std::string& name(int v) const { return table_.nodes[v].def->name(); }
  int producer(int t) const { return table_.tensors[t].node; }
  bool IsBatchInput(int q, int port) const {
    const std::vector<int>& ports = batch_.nodes[q].batch_inputs;
    return std::find(ports.begin(), ports.end(), port) != ports.end();
  }
  bool IsShapeInput(int q, int port) const {
    const std::vector<int>& ports = batch_.nodes[q].shape_inputs;
    return std::find(ports.begin(), ports.end(), port) != ports.end();
  }

  // A region node reads region tensors only where it cuts along the batch, and
  // never a reduction's partial sum.
  absl::Status Check() const {
    for (int q : region_) {
      for (size_t port = 0; port < node(q).inputs.size(); ++port) {
        const int p = producer(node(q).inputs[port]);
        if (!in_region_[p]) continue;
        if (!IsBatchInput(q, static_cast<int>(port))) {
          return absl::InvalidArgumentError(absl::StrCat(
              "split: ", name(q), " reads region tensor ", name(p), " whole"));
        }
        if (batch_.nodes[p].role == BatchRole::kReduce) {
          return absl::InvalidArgumentError(absl::StrCat(
              "split: ", name(q), " reads the batch reduction ", name(p)));
        }
      }
    }
    return absl::OkStatus();
  }

  // Stage of a region node: the most times a path to it leaves the region (and
  // comes back). No path leaves a stage and re-enters it.
  void FindStages() {
    const int n = static_cast<int>(table_.nodes.size());
    std::vector<int> exits(n, 0);
    for (int v : order_) {
      int e = 0;
      auto from = [&](int u) {
        // A shape reader that becomes a constant, or a constant that waited for a
        // region op (constant folding leaves such edges from folded shape ops),
        // does not leave the region: its value is static.
        if ((replaced_[v] || Static(v)) && in_region_[u]) return;
        e = std::max(e, exits[u] + (in_region_[u] && !in_region_[v] ? 1 : 0));
      };
      for (int t : node(v).inputs) from(producer(t));
      for (int u : node(v).control_inputs) from(u);
      exits[v] = e;
    }
    std::set<int> levels;
    for (int q : region_) levels.insert(exits[q]);
    std::map<int, int> dense;
    for (int level : levels) dense[level] = static_cast<int>(dense.size());
    stage_.assign(n, -1);
    for (int q : region_) stage_[q] = dense[exits[q]];
    summary_->stages = static_cast<int>(dense.size());
    // Entries (no predecessor in the same stage) and sinks (no successor there).
    // Barriers are per stage and device: the slices of a replicated step's replicas
    // (tf.distribute, one replica per device) chain on their own devices. One barrier
    // for all would make each replica's next slice wait for every replica's slice
    // (the replicas, which run side by side, in step), through control edges that TF
    // sends between the devices as _Send/_Recv pairs.
    std::vector<std::string> devices;
    for (int q : region_) devices.push_back(node(q).def->device());
    std::sort(devices.begin(), devices.end());
    devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
    const int num_devices = static_cast<int>(devices.size());
    group_.assign(n, -1);
    for (int q : region_) {
      const int device = static_cast<int>(
          std::lower_bound(devices.begin(), devices.end(), node(q).def->device()) -
          devices.begin());
      group_[q] = stage_[q] * num_devices + device;
    }
    entry_.assign(n, true);
    sink_.assign(n, true);
    for (int q : region_) {
      auto link = [&](int u) {
        if (in_region_[u] && group_[u] == group_[q]) {
          entry_[q] = false;
          sink_[u] = false;
        }
      };
      for (int t : node(q).inputs) link(producer(t));
      for (int u : node(q).control_inputs) link(u);
    }
    group_first_.assign(dense.size() * num_devices, -1);
    for (int q : region_) {
      if (group_first_[group_[q]] < 0) group_first_[group_[q]] = q;
    }
  }

  // Shape ops outside the region that read a region tensor become constants.
  void FindShapeReaders() {
    const int n = static_cast<int>(table_.nodes.size());
    replaced_.assign(n, false);
    for (int v = 0; v < n; ++v) {
      if (in_region_[v] || !ReadsShapeOnly(node(v).def->op()) ||
          spec_.preserved.count(name(v))) {
        continue;
      }
      bool reads_region = false, known = true;
      for (int t : node(v).inputs) {
        reads_region = reads_region || in_region_[producer(t)];
        known = known && batch_.shape_known[t];
      }
      if (!reads_region || !known) continue;
      if (node(v).def->op() == "ShapeN" ? node(v).outputs.size() != node(v).inputs.size()
                                        : node(v).outputs.size() != 1 || node(v).inputs.size() != 1) {
        continue;
      }
      replaced_[v] = true;
      ++num_replaced_;
      ++summary_->shape_constants;
      const std::string& op = node(v).def->op();
      DataType out_type = tensorflow::DT_INT32;
      auto it = node(v).def->attr().find("out_type");
      if (it != node(v).def->attr().end()) out_type = it->second.type();
      for (size_t j = 0; j < node(v).outputs.size(); ++j) {
        const std::vector<int64_t>& shape = batch_.shapes[node(v).inputs[j]];
        const std::string value_name = absl::StrCat(kSplitScope, name(v), "/value_", j);
        if (op == "Shape" || op == "ShapeN") {
          extra_.push_back(IntVectorConst(value_name, node(v).def->device(), out_type, shape));
        } else {
          int64_t value = static_cast<int64_t>(shape.size());
          if (op == "Size") {
            value = 1;
            for (int64_t d : shape) value *= d;
          }
          extra_.push_back(IntScalarConst(value_name, node(v).def->device(), out_type, value));
        }
        replacement_[node(v).outputs[j]] = value_name;
      }
    }
  }

  // Control inputs standing for node `v` once it is removed: its slices (region)
  // or, for a replaced shape op, what it waited for.
  void ControlFor(int v, std::vector<std::string>* deps) const {
    if (in_region_[v]) {
      for (int i = 0; i < k_; ++i) deps->push_back(absl::StrCat("^", SliceName(v, i)));
    } else if (replaced_[v]) {
      // Its value is static: what it waited for, but not the region it measured.
      for (int t : node(v).inputs) {
        if (!in_region_[producer(t)]) ControlFor(producer(t), deps);
      }
      for (int u : node(v).control_inputs) {
        if (!in_region_[u]) ControlFor(u, deps);
      }
    } else {
      deps->push_back(absl::StrCat("^", name(v)));
    }
  }

  std::string SliceName(int q, int i) const {
    return absl::StrCat(kSplitScope, name(q), "/slice_", i);
  }
  // The barrier after slice `i` of a barrier group (a stage on one device).
  std::string DoneName(int group, int i) const {
    const int first = group_first_[group];
    return absl::StrCat(kSplitScope, name(first), "/done_", stage_[first], "_", i);
  }

  // The tensor an outside reader (or a whole input of a slice) reads instead of `t`.
  std::string OutsideRef(int t) {
    const int p = producer(t);
    const int port = table_.tensors[t].port;
    if (in_region_[p]) {
      joined_.insert(t);
      if (batch_.nodes[p].role == BatchRole::kReduce) {
        return absl::StrCat(kSplitScope, name(p), "/sum_", port, "_", k_ - 1);
      }
      return absl::StrCat(kSplitScope, name(p), "/join_", port);
    }
    auto it = replacement_.find(t);
    if (it != replacement_.end()) return it->second;
    return TensorRef(name(p), port);
  }

  void AddControls(const std::vector<std::string>& deps, NodeDef* def) {
    std::set<std::string> seen;
    for (const std::string& input : def->input()) seen.insert(input);
    for (const std::string& dep : deps) {
      if (seen.insert(dep).second) def->add_input(dep);
    }
  }

  absl::Status EmitOutside(int v) {
    NodeDef* def = out_->add_node();
    *def = *node(v).def;
    def->clear_input();
    for (int t : node(v).inputs) def->add_input(OutsideRef(t));
    DropColocationWithRemoved(def);
    std::vector<std::string> deps;
    for (int u : node(v).control_inputs) {
      if (!(Static(v) && in_region_[u])) ControlFor(u, &deps);
    }
    AddControls(deps, def);
    return absl::OkStatus();
  }

  // Colocation constraints (`_class: loc:@<node>`) with a node the split removed
  // would name a node that no longer exists: they are dropped.
  void DropColocationWithRemoved(NodeDef* def) const {
    auto it = def->mutable_attr()->find("_class");
    if (it == def->mutable_attr()->end() || !it->second.has_list()) return;
    tensorflow::AttrValue kept;
    kept.mutable_list();
    for (const std::string& entry : it->second.list().s()) {
      bool removed = false;
      if (absl::StartsWith(entry, "loc:@")) {
        auto found = table_.node_index.find(entry.substr(5));
        removed = found != table_.node_index.end() &&
                  (in_region_[found->second] || replaced_[found->second]);
      }
      if (!removed) kept.mutable_list()->add_s(entry);
    }
    if (kept.list().s_size() == 0) {
      def->mutable_attr()->erase(it);
    } else {
      it->second = kept;
    }
  }

  // A constant's value does not depend on what it waits for.
  bool Static(int v) const { return node(v).def->op() == "Const"; }

  absl::Status EmitSlice(int q, int i) {
    NodeDef* def = out_->add_node();
    *def = *node(q).def;
    def->set_name(SliceName(q, i));
    def->clear_input();
    def->mutable_attr()->erase("_output_shapes");
    def->mutable_attr()->erase("_class");
    for (size_t port = 0; port < node(q).inputs.size(); ++port) {
      const int t = node(q).inputs[port];
      const int p = producer(t);
      if (IsBatchInput(q, static_cast<int>(port))) {
        if (in_region_[p]) {
          def->add_input(TensorRef(SliceName(p, i), table_.tensors[t].port));
        } else {
          def->add_input(CutName(t, i));
          auto it = cut_group_.find({t, i});
          if (it == cut_group_.end()) {
            cut_group_[{t, i}] = group_[q];
          } else {
            it->second = std::min(it->second, group_[q]);
          }
          cut_device_.emplace(t, node(q).def->device());
        }
      } else if (IsShapeInput(q, static_cast<int>(port)) ||
                 batch_.nodes[q].multiples_input == static_cast<int>(port)) {
        // The slice's output shape; for a Tile of one row, its multiples (the
        // output's shape over the input's), the slice's rows first.
        std::vector<int64_t> shape = batch_.shapes[node(q).outputs[0]];
        if (batch_.nodes[q].multiples_input == static_cast<int>(port)) {
          const std::vector<int64_t>& input = batch_.shapes[node(q).inputs[0]];
          for (size_t d = 0; d < shape.size() && d < input.size(); ++d) {
            shape[d] = input[d] > 0 ? shape[d] / input[d] : shape[d];
          }
        }
        shape[0] = rows_[i];
        const std::string const_name = absl::StrCat(kSplitScope, name(q), "/shape_", port, "_", i);
        extra_.push_back(IntVectorConst(const_name, node(q).def->device(),
                                        table_.tensors[t].dtype, shape));
        def->add_input(const_name);
      } else {
        if (in_region_[p]) {
          return absl::InvalidArgumentError(
              absl::StrCat("split: ", name(q), " reads region tensor ", name(p), " whole"));
        }
        def->add_input(OutsideRef(t));
      }
    }
    std::vector<std::string> deps;
    for (int u : node(q).control_inputs) {
      if (in_region_[u]) {
        deps.push_back(absl::StrCat("^", SliceName(u, i)));
      } else {
        ControlFor(u, &deps);
      }
    }
    if (entry_[q] && i > 0) deps.push_back(absl::StrCat("^", DoneName(group_[q], i - 1)));
    AddControls(deps, def);
    return absl::OkStatus();
  }

  std::string CutName(int t, int i) const {
    return absl::StrCat(kSplitScope, name(producer(t)), "/cut_", table_.tensors[t].port, "_", i);
  }

  void EmitCuts() {
    std::vector<int64_t> begin(rows_.size(), 0);
    for (size_t i = 1; i < rows_.size(); ++i) begin[i] = begin[i - 1] + rows_[i - 1];
    for (const auto& [key, group] : cut_group_) {
      const auto [t, i] = key;
      const std::string cut = CutName(t, i);
      const std::string& device = cut_device_.at(t);
      const size_t rank = batch_.shapes[t].size();
      // Sizes spelled out (no -1): TF's cost estimator rejects a -1 size.
      std::vector<int64_t> starts(rank, 0), sizes = batch_.shapes[t];
      starts[0] = begin[i];
      sizes[0] = rows_[i];
      extra_.push_back(IntVectorConst(cut + "/begin", device, tensorflow::DT_INT32, starts));
      extra_.push_back(IntVectorConst(cut + "/size", device, tensorflow::DT_INT32, sizes));
      NodeDef slice;
      slice.set_name(cut);
      slice.set_op("Slice");
      slice.set_device(device);
      slice.add_input(OutsideRef(t));
      slice.add_input(cut + "/begin");
      slice.add_input(cut + "/size");
      if (i > 0) slice.add_input(absl::StrCat("^", DoneName(group, i - 1)));
      (*slice.mutable_attr())["T"].set_type(table_.tensors[t].dtype);
      (*slice.mutable_attr())["Index"].set_type(tensorflow::DT_INT32);
      extra_.push_back(std::move(slice));
    }
    std::set<int> tensors;
    for (const auto& [key, group] : cut_group_) tensors.insert(key.first);
    summary_->cuts = static_cast<int>(tensors.size());
  }

  void EmitJoins() {
    for (int t : joined_) {
      const int q = producer(t);
      const int port = table_.tensors[t].port;
      const std::string& device = node(q).def->device();
      const DataType dtype = table_.tensors[t].dtype;
      if (batch_.nodes[q].role == BatchRole::kReduce) {
        // Partial sums added in slice order: ((s0 + s1) + s2) + ...; each partial
        // is freed as soon as it is added.
        std::string acc = TensorRef(SliceName(q, 0), port);
        for (int i = 1; i < k_; ++i) {
          NodeDef add;
          add.set_name(absl::StrCat(kSplitScope, name(q), "/sum_", port, "_", i));
          add.set_op("AddV2");
          add.set_device(device);
          add.add_input(acc);
          add.add_input(TensorRef(SliceName(q, i), port));
          (*add.mutable_attr())["T"].set_type(dtype);
          acc = add.name();
          extra_.push_back(std::move(add));
        }
        ++summary_->sums;
        continue;
      }
      const std::string join = absl::StrCat(kSplitScope, name(q), "/join_", port);
      extra_.push_back(IntScalarConst(join + "/axis", device, tensorflow::DT_INT32, 0));
      NodeDef concat;
      concat.set_name(join);
      concat.set_op("ConcatV2");
      concat.set_device(device);
      for (int i = 0; i < k_; ++i) concat.add_input(TensorRef(SliceName(q, i), port));
      concat.add_input(join + "/axis");
      (*concat.mutable_attr())["N"].set_i(k_);
      (*concat.mutable_attr())["T"].set_type(dtype);
      (*concat.mutable_attr())["Tidx"].set_type(tensorflow::DT_INT32);
      extra_.push_back(std::move(concat));
      ++summary_->joins;
    }
  }

  void EmitBarriers() {
    for (int g = 0; g < static_cast<int>(group_first_.size()); ++g) {
      if (group_first_[g] < 0) continue;  // no region op of this stage on the device
      for (int i = 0; i + 1 < k_; ++i) {
        NodeDef done;
        done.set_name(DoneName(g, i));
        done.set_op("NoOp");
        done.set_device(node(group_first_[g]).def->device());
        for (int q : region_) {
          if (group_[q] != g || !sink_[q] || MergedIntoLaterStage(q)) continue;
          done.add_input(absl::StrCat("^", SliceName(q, i)));
        }
        extra_.push_back(std::move(done));
      }
    }
  }

  // oneDNN's layout pass (at run time, after Grappler) merges a BiasAddGrad into
  // the Conv2DBackpropFilter that reads the same gradient. If that one belongs to
  // a later stage, a barrier waiting for the BiasAddGrad would wait for the merged
  // op, and so for the later stage: a cycle. Such a BiasAddGrad is no barrier sink.
  bool MergedIntoLaterStage(int q) const {
    if (node(q).def->op() != "BiasAddGrad" || node(q).inputs.empty()) return false;
    for (int c : table_.tensors[node(q).inputs[0]].consumers) {
      const std::string& op = node(c).def->op();
      if ((op == "Conv2DBackpropFilter" || op == "DepthwiseConv2dNativeBackpropFilter") &&
          (!in_region_[c] || stage_[c] != stage_[q])) {
        return true;
      }
    }
    return false;
  }

  const tensorflow::GraphDef& graph_;
  const TensorTable& table_;
  const std::vector<int>& order_;
  const BatchAnalysis& batch_;
  const SplitSpec& spec_;
  tensorflow::GraphDef* out_;
  SplitSummary* summary_;
  const int k_;
  std::vector<int64_t> rows_;
  std::vector<bool> in_region_, entry_, sink_, replaced_;
  std::vector<int> region_, stage_;
  std::vector<int> group_;        // barrier group of a region node: stage * devices + device
  std::vector<int> group_first_;  // group -> its first region node (-1: none)
  int num_replaced_ = 0;
  std::map<int, std::string> replacement_;  // tensor -> constant standing for it
  std::set<int> joined_;                    // region tensors read outside
  std::map<std::pair<int, int>, int> cut_group_;  // (tensor, slice) -> earliest group
  std::map<int, std::string> cut_device_;
  std::vector<NodeDef> extra_;
};

}  // namespace

int64_t SliceUnit(const TensorTable& table, const BatchAnalysis& batch,
                  const std::vector<int>& region) {
  int64_t unit = 1;
  auto align = [&](int t) {
    // Integer and boolean kernels compute every element exactly, vectorized or not.
    if (!tensorflow::DataTypeIsFloating(table.tensors[t].dtype)) return;
    const int64_t row_bytes = table.tensors[t].bytes / std::max<int64_t>(batch.batch, 1);
    if (row_bytes <= 0) return;
    const int64_t rows = 64 / std::gcd<int64_t>(64, row_bytes);
    unit = std::lcm(unit, rows);
  };
  for (int q : region) {
    const NodeInfo& node = table.nodes[q];
    for (int port : batch.nodes[q].batch_inputs) align(node.inputs[port]);
    if (batch.nodes[q].role == BatchRole::kPerSample) {
      for (int t : node.outputs) align(t);
    }
  }
  return unit;
}

std::vector<int64_t> SliceRows(int64_t batch, int slices, int64_t unit) {
  const int64_t units = batch / unit;
  if (slices < 1 || units < slices) return {};
  std::vector<int64_t> rows(slices, units / slices * unit);
  for (int64_t i = 0; i < units % slices; ++i) rows[i] += unit;
  rows.back() += batch % unit;
  return rows;
}

absl::Status BuildSplitGraph(const tensorflow::GraphDef& graph, const TensorTable& table,
                             const std::vector<int>& order, const BatchAnalysis& batch,
                             const SplitSpec& spec, tensorflow::GraphDef* out,
                             SplitSummary* summary) {
  SplitBuilder builder(graph, table, order, batch, spec, out, summary);
  return builder.Build();
}

}  // namespace tfmemopt
