#include "grappler/analyze/per_sample.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_set.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/costs/graph_properties.h"
#include "tensorflow/core/grappler/op_types.h"

namespace tfmemopt {
namespace {

using tensorflow::NodeDef;

// Port 0 carries the batch; any other input is used whole.
bool FirstInputOp(const std::string& op) {
  static const auto* ops = new absl::flat_hash_set<std::string>{
      // Convolutions and pooling (NHWC or NCHW: dimension 0 is the batch).
      "Conv2D", "_FusedConv2D", "DepthwiseConv2dNative", "_FusedDepthwiseConv2dNative",
      "Conv3D", "MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D", "LRN", "BiasAdd",
      "BiasAddV1",
      // Activations and other one-input element-wise ops.
      "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Gelu", "Tanh", "Sigmoid", "Softplus",
      "Softsign", "_MklSwish", "Exp", "Expm1", "Log", "Log1p", "Neg", "Abs", "Square",
      "Sqrt", "Rsqrt", "Reciprocal", "Inv", "Sin", "Cos", "Erf", "Erfc", "Floor", "Ceil",
      "Round", "Rint", "Sign", "Cast", "Identity", "Snapshot", "StopGradient",
      "PreventGradient", "ZerosLike", "OnesLike", "IsFinite", "LogicalNot",
      // Along the last axis, per row.
      "Softmax", "LogSoftmax",
      // Shape changes that keep dimension 0 (checked on the shapes).
      "Reshape", "Squeeze", "ExpandDims"};
  return ops->count(op) > 0;
}

// Contractions the remapper fused with their bias, activation, batch norm or a
// residual Add (those the classifier cuts along input 0); inputs 2.. are the fused
// ops' arguments.
bool FusedContraction(const std::string& op) {
  return op == "_FusedConv2D" || op == "_FusedMatMul" || op == "_FusedDepthwiseConv2dNative";
}

// Element-wise ops of several inputs: an input with the output's rank and batch is
// cut, one broadcast along the batch (dimension 0 of size 1, or a lower rank) is
// used whole.
bool ElementwiseOp(const std::string& op) {
  static const auto* ops = new absl::flat_hash_set<std::string>{
      "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Maximum",
      "Minimum", "SquaredDifference", "Pow", "FloorDiv", "FloorMod", "Atan2", "Xdivy",
      "Xlogy", "AddN", "SelectV2", "Equal", "NotEqual", "Greater",
      "GreaterEqual", "Less", "LessEqual", "LogicalAnd", "LogicalOr",
      // Gradients of activations.
      "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad",
      "SigmoidGrad", "SoftplusGrad", "SoftsignGrad", "SqrtGrad", "RsqrtGrad",
      "ReciprocalGrad", "InvGrad", "GeluGrad"};
  return ops->count(op) > 0;
}

bool GetBool(const NodeDef& node, const std::string& attr) {
  auto it = node.attr().find(attr);
  return it != node.attr().end() && it->second.b();
}

// Integer contents of a Const node, or false.
bool ConstInts(const NodeDef& node, std::vector<int64_t>* values) {
  if (node.op() != "Const" || !node.attr().count("value")) return false;
  tensorflow::Tensor tensor;
  if (!tensor.FromProto(node.attr().at("value").tensor())) return false;
  values->clear();
  if (tensor.dtype() == tensorflow::DT_INT32) {
    for (int64_t i = 0; i < tensor.NumElements(); ++i) values->push_back(tensor.flat<int32_t>()(i));
  } else if (tensor.dtype() == tensorflow::DT_INT64) {
    for (int64_t i = 0; i < tensor.NumElements(); ++i) values->push_back(tensor.flat<int64_t>()(i));
  } else {
    return false;
  }
  return true;
}

bool PlainValue(tensorflow::DataType dtype) {
  return dtype != tensorflow::DT_RESOURCE && dtype != tensorflow::DT_VARIANT &&
         dtype != tensorflow::DT_STRING && dtype != tensorflow::DT_INVALID &&
         !tensorflow::IsRefType(dtype);
}

class Classifier {
 public:
  Classifier(const TensorTable& table, const BatchAnalysis& analysis,
             bool through_batch_statistics)
      : table_(table), a_(analysis), through_batch_statistics_(through_batch_statistics) {}

  // A tensor cut along the batch: known, plain, rank >= 1, dimension 0 the batch.
  bool BatchShaped(int t) const {
    return a_.shape_known[t] && !a_.shapes[t].empty() && a_.shapes[t][0] == a_.batch &&
           PlainValue(table_.tensors[t].dtype);
  }

  // An op that makes a batch-shaped output from input 0 of at most one row: of a
  // lower rank, or of the output's rank with dimension 0 of size 1.
  bool MakesBatchFromOneRow(const NodeInfo& node) const {
    if (node.inputs.empty() || node.outputs.size() != 1) return false;
    const int in = node.inputs[0];
    const int out = node.outputs[0];
    if (!a_.shape_known[in] || !BatchShaped(out)) return false;
    const std::vector<int64_t>& shape = a_.shapes[in];
    return shape.size() < a_.shapes[out].size() || (!shape.empty() && shape[0] == 1);
  }

  // The remapper's fused contractions take, after input and filter, the arguments of
  // their fused ops (attr num_args): a bias or batch-norm vectors, used whole, and
  // for an Add (a residual connection: MatMul + BiasAdd + Add, which TF's oneDNN
  // remapper fuses) an addend of the output's shape, which is cut like input 0. A
  // slice must never read the whole addend: oneDNN adds it in place into a slice's
  // output of fewer rows. False when an argument's shape is neither.
  bool FusedArgsBatchInputs(const NodeInfo& node, BatchUse* use) const {
    if (node.outputs.empty() || !a_.shape_known[node.outputs[0]]) return false;
    const size_t rank = a_.shapes[node.outputs[0]].size();
    for (int port = 2; port < static_cast<int>(node.inputs.size()); ++port) {
      const int t = node.inputs[port];
      if (!a_.shape_known[t]) return false;
      const std::vector<int64_t>& shape = a_.shapes[t];
      if (shape.size() == rank && BatchShaped(t)) {
        use->batch_inputs.push_back(port);
      } else if (shape.size() == rank && !shape.empty() && shape[0] != 1) {
        return false;  // as many rows as neither the batch nor one
      }
    }
    return true;
  }

  // The constant behind input `port` of `node`, if its producer is a Const.
  bool InputInts(const NodeInfo& node, int port, std::vector<int64_t>* values) const {
    if (port >= static_cast<int>(node.inputs.size())) return false;
    return ConstInts(*table_.nodes[table_.tensors[node.inputs[port]].node].def, values);
  }

  BatchUse Classify(const NodeInfo& node) const {
    BatchUse use;
    const std::string& op = node.def->op();
    const int inputs = static_cast<int>(node.inputs.size());
    BatchRole role = BatchRole::kPerSample;
    if (FirstInputOp(op) || ((op == "MatMul" || op == "_FusedMatMul") &&
                             !GetBool(*node.def, "transpose_a"))) {
      if (inputs < 1) return Not("op");
      use.batch_inputs = {0};
      if (op == "Reshape") use.shape_inputs = {1};
      // Softmax works along the last axis: per sample only if that is not the batch.
      if ((op == "Softmax" || op == "LogSoftmax") &&
          (node.outputs.empty() || a_.shapes[node.outputs[0]].size() < 2)) {
        return Not("shape");
      }
      if ((op == "MatMul" || op == "_FusedMatMul") && a_.shapes[node.inputs[0]].size() != 2) {
        return Not("shape");
      }
      if (FusedContraction(op) && !FusedArgsBatchInputs(node, &use)) return Not("shape");
    } else if (op == "MatMul" && GetBool(*node.def, "transpose_a") &&
               !GetBool(*node.def, "transpose_b")) {
      // A^T B over the batch: the weight gradient of a dense layer.
      role = BatchRole::kReduce;
      use.batch_inputs = {0, 1};
    } else if (ElementwiseOp(op)) {
      if (node.outputs.empty() || !a_.shape_known[node.outputs[0]]) return Not("shape");
      const size_t rank = a_.shapes[node.outputs[0]].size();
      if (rank == 0) return Not("shape");
      for (int port = 0; port < inputs; ++port) {
        const int t = node.inputs[port];
        if (!a_.shape_known[t]) return Not("shape");
        const std::vector<int64_t>& shape = a_.shapes[t];
        if (shape.size() == rank && BatchShaped(t)) {
          use.batch_inputs.push_back(port);
        } else if (shape.size() < rank || (shape.size() == rank && shape[0] == 1)) {
          // broadcast along the batch: used whole
        } else {
          return Not("shape");
        }
      }
    } else if (op == "ConcatV2") {
      std::vector<int64_t> axis;
      if (inputs < 2 || node.outputs.empty() || !InputInts(node, inputs - 1, &axis) ||
          axis.size() != 1) {
        return Not("op");
      }
      const int64_t rank = static_cast<int64_t>(a_.shapes[node.outputs[0]].size());
      if (axis[0] == 0 || axis[0] == -rank) return Not("op");  // along the batch
      for (int port = 0; port + 1 < inputs; ++port) use.batch_inputs.push_back(port);
    } else if (op == "MaxPoolGrad" || op == "MaxPoolGradV2") {
      use.batch_inputs = {0, 1, 2};
    } else if (op == "AvgPoolGrad") {
      use.shape_inputs = {0};
      use.batch_inputs = {1};
    } else if (op == "Conv2DBackpropInput" || op == "DepthwiseConv2dNativeBackpropInput" ||
               op == "Conv3DBackpropInputV2") {
      use.shape_inputs = {0};
      use.batch_inputs = {2};
    } else if (op == "SparseSoftmaxCrossEntropyWithLogits" ||
               op == "SoftmaxCrossEntropyWithLogits") {
      use.batch_inputs = {0, 1};
    } else if (op == "Conv2DBackpropFilter" || op == "DepthwiseConv2dNativeBackpropFilter" ||
               op == "Conv3DBackpropFilterV2") {
      role = BatchRole::kReduce;
      use.batch_inputs = {0, 2};
    } else if (op == "BiasAddGrad") {
      role = BatchRole::kReduce;
      use.batch_inputs = {0};
    } else if (op == "Sum" || op == "Mean" || op == "Max" || op == "Min" || op == "Prod") {
      // Along other axes a reduction is per sample (global pooling); a Sum along
      // the batch is a batch reduction.
      std::vector<int64_t> axes;
      if (inputs != 2 || !InputInts(node, 1, &axes)) return Not("op");
      const int64_t rank = static_cast<int64_t>(a_.shapes[node.inputs[0]].size());
      bool over_batch = false;
      for (int64_t axis : axes) over_batch = over_batch || axis == 0 || axis == -rank;
      if (over_batch && op != "Sum") return Not("op");
      if (over_batch) role = BatchRole::kReduce;
      use.batch_inputs = {0};
    } else if (op == "Pad" || op == "PadV2" || op == "MirrorPad") {
      // Padding of the other dimensions (ZeroPadding2D, a causal Conv1D's left
      // padding) is per sample; the paddings, and PadV2's value, are used whole.
      // Padding along the batch adds rows: not per sample.
      std::vector<int64_t> paddings;
      if (inputs < 2 || !InputInts(node, 1, &paddings) || paddings.size() < 2 ||
          paddings[0] != 0 || paddings[1] != 0) {
        return Not("op");
      }
      use.batch_inputs = {0};
    } else if (op == "Select") {
      // The condition has the inputs' shape, or is a vector over dimension 0: cut
      // along the batch either way.
      use.batch_inputs = {0, 1, 2};
    } else if (op == "Slice") {
      // A slice of other axes (a concatenation's gradient): begin 0 along the batch,
      // and a size per slice.
      std::vector<int64_t> begin;
      if (inputs != 3 || !InputInts(node, 1, &begin) || begin.empty() || begin[0] != 0) {
        return Not("op");
      }
      use.batch_inputs = {0};
      use.shape_inputs = {2};
    } else if (op == "Tile") {
      std::vector<int64_t> multiples;
      if (inputs != 2 || !InputInts(node, 1, &multiples) || multiples.empty()) {
        return Not("op");
      }
      if (multiples[0] == 1) {
        use.batch_inputs = {0};
      } else if (MakesBatchFromOneRow(node) && multiples[0] == a_.batch) {
        if (!through_batch_statistics_) return NotThroughStatistics(node);
        use.multiples_input = 1;
      } else {
        return Not("op");
      }
    } else if (op == "BroadcastTo") {
      if (inputs != 2 || !MakesBatchFromOneRow(node)) return Not("op");
      if (!through_batch_statistics_) return NotThroughStatistics(node);
      use.shape_inputs = {1};
    } else {
      return Not("op");
    }
    if (role == BatchRole::kReduce && !node.backward) return Not("forward_reduction");
    const bool makes_batch = op == "BroadcastTo" || use.multiples_input >= 0;
    if (use.batch_inputs.empty() && !makes_batch) return Not("shape");
    for (int port : use.batch_inputs) {
      if (port >= inputs || !BatchShaped(node.inputs[port])) return Not("shape");
    }
    if (role == BatchRole::kPerSample) {
      if (node.outputs.empty()) return Not("shape");
      for (int t : node.outputs) {
        if (!BatchShaped(t)) return Not("shape");
      }
    } else {
      for (int t : node.outputs) {
        if (!a_.shape_known[t] || !PlainValue(table_.tensors[t].dtype)) return Not("shape");
      }
    }
    for (int port : use.shape_inputs) {
      if (port >= inputs) return Not("op");
      const tensorflow::DataType dtype = table_.tensors[node.inputs[port]].dtype;
      if (dtype != tensorflow::DT_INT32 && dtype != tensorflow::DT_INT64) return Not("op");
    }
    use.role = role;
    return use;
  }

 private:
  // Without the option a maker ends the regions. In the backward pass it spreads a
  // gradient of a mean over the batch (batch normalization's): counted apart, so
  // that the report can name the option. A forward one (a class token tiled over
  // the batch) has nothing to do with it.
  static BatchUse NotThroughStatistics(const NodeInfo& node) {
    return Not(node.backward ? "batch_statistics" : "op");
  }

  static BatchUse Not(const char* why) {
    BatchUse use;
    use.why_not = why;
    return use;
  }

  const TensorTable& table_;
  const BatchAnalysis& a_;
  const bool through_batch_statistics_;
};

}  // namespace

absl::Status AnalyzeBatch(const tensorflow::grappler::GrapplerItem& item,
                          const TensorTable& table, const ControlFlowInfo& flow,
                          bool through_batch_statistics, BatchAnalysis* analysis) {
  *analysis = BatchAnalysis();
  tensorflow::grappler::GraphProperties properties(item);
  absl::Status status = properties.InferStatically(
      /*assume_valid_feeds=*/true, /*aggressive_shape_inference=*/false,
      /*include_input_tensor_values=*/false, /*include_output_tensor_values=*/false);
  if (!status.ok()) return status;
  const size_t num_tensors = table.tensors.size();
  analysis->shapes.assign(num_tensors, {});
  analysis->shape_known.assign(num_tensors, false);
  for (size_t t = 0; t < num_tensors; ++t) {
    const TensorInfo& tensor = table.tensors[t];
    const std::string& name = table.nodes[tensor.node].def->name();
    if (!properties.HasOutputProperties(name)) continue;
    const auto& outputs = properties.GetOutputProperties(name);
    if (tensor.port >= static_cast<int>(outputs.size())) continue;
    const tensorflow::TensorShapeProto& shape = outputs[tensor.port].shape();
    if (shape.unknown_rank()) continue;
    bool known = true;
    for (const auto& dim : shape.dim()) {
      known = known && dim.size() >= 0;
      analysis->shapes[t].push_back(dim.size());
    }
    analysis->shape_known[t] = known;
  }
  // The batch: dimension 0 of the largest graph input (or iterator output).
  int64_t largest = -1;
  for (size_t t = 0; t < num_tensors; ++t) {
    const NodeDef& producer = *table.nodes[table.tensors[t].node].def;
    const std::string& op = producer.op();
    const bool input = op == "_Arg" || op == "Placeholder" || op == "PlaceholderWithDefault" ||
                       op == "IteratorGetNext" || op == "IteratorGetNextSync";
    if (!input || !analysis->shape_known[t] || analysis->shapes[t].empty() ||
        !PlainValue(table.tensors[t].dtype)) {
      continue;
    }
    if (table.tensors[t].bytes > largest) {
      largest = table.tensors[t].bytes;
      analysis->batch = analysis->shapes[t][0];
    }
  }
  analysis->nodes.assign(table.nodes.size(), BatchUse());
  if (analysis->batch < 2) {
    for (BatchUse& use : analysis->nodes) use.why_not = "batch_unknown";
    return absl::OkStatus();
  }
  Classifier classifier(table, *analysis, through_batch_statistics);
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    const NodeInfo& node = table.nodes[n];
    BatchUse& use = analysis->nodes[n];
    if (node.stateful) {
      use.why_not = "stateful";
    } else if (flow.Under(static_cast<int>(n))) {
      use.why_not = "control_flow";
    } else {
      use = classifier.Classify(node);
    }
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
