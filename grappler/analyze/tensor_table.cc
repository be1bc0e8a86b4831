#include "grappler/analyze/tensor_table.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grappler/analyze/function_bodies.h"
#include "grappler/analyze/initial_values.h"
#include "grappler/analyze/kernel_memory.h"
#include "grappler/analyze/op_costs.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/costs/graph_properties.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "tensorflow/core/util/util.h"

namespace tfmemopt {
namespace {

using tensorflow::DataType;
using tensorflow::NodeDef;
using tensorflow::OpInfo;
using tensorflow::grappler::GraphProperties;
using tensorflow::grappler::GrapplerItem;

}  // namespace

// ReadVariableOp hands out the variable's own buffer (copy-on-write); loop
// plumbing (Enter/Merge/Switch/NextIteration/Exit) and the TensorList update ops
// pass their buffer through, and an element taken from a list is part of the
// list's storage. DestroyTemporaryVariable hands out the temporary variable's
// tensor as the sum (variable_ops.cc), the end of the running totals TF's memory
// optimizer writes (analyze/arrival_order_sums.h).
int ForwardedInput(const NodeDef& node, int port) {
  static const auto* same_port = new std::set<std::string>{
      "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
      "PreventGradient", "EnsureShape", "Bitcast", "_Retval", "Snapshot",
      "ReadVariableOp"};
  // Output 0 is input 0 (Merge's output 1 and PopBack's element are new).
  static const auto* first_output = new std::set<std::string>{
      "Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
      "Merge", "RefMerge", "TensorListPushBack", "TensorListPushBackBatch",
      "TensorListSetItem", "TensorListPopBack", "DestroyTemporaryVariable"};
  if (same_port->count(node.op())) return port;
  if (node.op() == "Switch" || node.op() == "RefSwitch") return 0;  // both branches
  // An element read or popped from a TensorList is the list's own tensor (the
  // kernels hand out the stored Tensor, sharing its buffer).
  if (node.op() == "TensorListGetItem" || node.op() == "TensorListPopBack") return 0;
  if (first_output->count(node.op())) return port == 0 ? 0 : -1;
  // Updates of a reference variable (tf.compat.v1 variables: Assign*, Apply* and
  // Scatter*) hand out the variable itself, input 0, as their output.
  if (port == 0 && (node.op() == "RefIdentity" || node.op() == "Assign" ||
                    node.op() == "AssignAdd" || node.op() == "AssignSub" ||
                    absl::StartsWith(node.op(), "Apply") ||
                    absl::StartsWith(node.op(), "SparseApply") ||
                    (absl::StartsWith(node.op(), "Scatter") && node.op() != "ScatterNd" &&
                     node.op() != "ScatterNdNonAliasingAdd"))) {
    return 0;
  }
  return -1;
}

namespace {

// The op of tfmemopt's CPU swap-out (grappler/ops/swap_ops.h): its output is held
// in host memory, outside the device allocator.
constexpr char kSwappedOutOp[] = "TfMemSwapOut";

// An Identity from one device to another (a swap on a GPU) is a copy: TF inserts a
// transfer and the output is a new buffer on the node's own device.
bool SameDeviceAsInput(const TensorTable& table, const NodeInfo& node, int port) {
  const int producer = table.tensors[node.inputs[port]].node;
  return table.nodes[producer].device == node.device;
}

bool ForwardsInputBuffer(const NodeDef& node) {
  return ForwardedInput(node, 0) >= 0;
}

// A Slice along dimension 0 only, of a tensor whose rows are aligned, hands out a
// view of its input (TF's SharedSliceCommonCases: IsDim0SliceAligned, or the whole
// input): no allocation, and the input's buffer lives as long as the view. The
// split rewrite cuts batches this way. (Rank 1 needs the offsets; counted as a copy.)
bool SliceIsView(const NodeDef& node, const GraphProperties& properties) {
  if (node.op() != "Slice" || !properties.HasInputProperties(node.name()) ||
      !properties.HasOutputProperties(node.name())) {
    return false;
  }
  const auto& inputs = properties.GetInputProperties(node.name());
  const auto& outputs = properties.GetOutputProperties(node.name());
  if (inputs.empty() || outputs.empty()) return false;
  const tensorflow::TensorShapeProto& in = inputs[0].shape();
  const tensorflow::TensorShapeProto& out = outputs[0].shape();
  if (in.unknown_rank() || out.unknown_rank() || in.dim_size() < 2 ||
      in.dim_size() != out.dim_size()) {
    return false;
  }
  int64_t inner = 1;
  for (int d = 0; d < in.dim_size(); ++d) {
    if (in.dim(d).size() < 0 || out.dim(d).size() < 0) return false;
    if (d > 0 && in.dim(d).size() != out.dim(d).size()) return false;
    if (d > 0) inner *= in.dim(d).size();
  }
  const int64_t element = tensorflow::DataTypeSize(inputs[0].dtype());
  if (element == 0 || in.dim(0).size() == 0) return false;
  return (inner * element) % EIGEN_MAX_ALIGN_BYTES == 0 || in.dim(0).size() == out.dim(0).size();
}

// Gradient code is named by tf.gradients ("gradients/") or GradientTape
// ("gradient_tape/"); everything downstream of it (the optimizer update) is
// backward too.
// A name scope that TF's differentiation opens: tf.gradients' "gradients" and
// GradientTape's "gradient_tape", or their uniquified forms ("gradients_1" when a
// script calls tf.gradients twice, and Grappler's deduplication may keep that copy).
bool IsGradientScopeName(absl::string_view scope) {
  for (absl::string_view base : {absl::string_view("gradients"), absl::string_view("gradient_tape")}) {
    if (!absl::StartsWith(scope, base)) continue;
    absl::string_view rest = scope.substr(base.size());
    if (rest.empty()) return true;
    if (rest.size() < 2 || rest[0] != '_') continue;
    bool digits = true;
    for (char c : rest.substr(1)) digits = digits && c >= '0' && c <= '9';
    if (digits) return true;
  }
  return false;
}

bool InGradientScope(const std::string& name) {
  const std::vector<absl::string_view> parts = absl::StrSplit(name, '/');
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (IsGradientScopeName(parts[i])) return true;
  }
  return false;
}

bool IsGraphInput(const NodeDef& node) {
  return node.op() == "Placeholder" || node.op() == "_Arg" ||
         node.op() == "PlaceholderWithDefault";
}

// Where a batch enters a step: graph inputs, and the tf.data iterator that Keras's
// fit reads its batches from.
bool IsBatchSource(const NodeDef& node) {
  return IsGraphInput(node) || node.op() == "IteratorGetNext" ||
         node.op() == "IteratorGetNextSync" || node.op() == "OptionalGetValue" ||
         node.op() == "MultiDeviceIteratorGetNextFromShard";
}

// Constants are held by their kernel and variables by their resource: both live
// for the whole step. (grappler::IsVariable also matches ReadVariableOp, which is
// a forward, so the variable ops are listed here.)
bool IsPersistentProducer(const NodeDef& node) {
  static const auto* variables = new std::set<std::string>{
      "VarHandleOp", "_VarHandlesOp", "VariableV2", "Variable", "AutoReloadVariable"};
  return tensorflow::grappler::IsConstant(node) || variables->count(node.op()) > 0;
}

struct ShapeBytes {
  int64_t bytes = 0;
  bool known = true;
  int64_t resolved_dims = 0;  // the inputs' batch, taken as batch_size
  int64_t assumed_dims = 0;   // other unknown dimensions, taken as batch_size
};

// Ops whose integer outputs describe shapes (one number per dimension at most).
bool IsShapeMetadataOp(const std::string& op) {
  return ReadsShapeOnly(op) || op == "TensorListElementShape" || op == "TensorListLength" ||
         op == "BroadcastGradientArgs" || op == "BroadcastArgs";
}

ShapeBytes SizeOf(const OpInfo::TensorProperties& props,
                  const std::set<int64_t>& batch_symbols, int64_t batch_size) {
  ShapeBytes out;
  // A reference (a tf.compat.v1 variable and what reads it by reference) has the
  // size of its value.
  const int64_t element = tensorflow::DataTypeSize(tensorflow::BaseType(props.dtype()));
  if (props.dtype() == tensorflow::DT_RESOURCE ||
      props.dtype() == tensorflow::DT_VARIANT || element == 0) {
    // Handles and variants: the bytes behind them are accounted elsewhere
    // (variables) or unknowable statically (strings, variants).
    out.known = props.dtype() == tensorflow::DT_RESOURCE;
    return out;
  }
  int64_t elements = 1;
  if (props.shape().unknown_rank()) {
    out.known = false;
  } else {
    for (const auto& dim : props.shape().dim()) {
      int64_t size = dim.size();
      if (size < 0 && batch_size > 0) {
        // The inputs' batch, or a dimension shape inference lost on the way (a loop's
        // per-iteration tensors and lists, whose element shapes it does not carry
        // through the loop; the rows boolean_mask keeps): in a training step those
        // are the batch or at most it, so the batch size is the estimate that does
        // not under-count them, where 1 would.
        size = batch_size;
        if (batch_symbols.count(dim.size())) {
          ++out.resolved_dims;
        } else {
          ++out.assumed_dims;
        }
      }
      if (size < 0) {
        out.known = false;
        size = 1;
      }
      elements *= size;
    }
  }
  out.bytes = elements * element;
  return out;
}

// The variable behind a resource handle: from the VarHandleOp's own dtype and
// shape when they are complete, else as its direct readers and writers see it
// (after function inlining they may reach it only through an Identity, hence the
// attributes first).
int64_t VariableBytes(const TensorTable& table, const GraphProperties& props,
                      int handle_tensor) {
  const NodeDef& producer = *table.nodes[table.tensors[handle_tensor].node].def;
  if (producer.op() == "VarHandleOp" && producer.attr().count("shape") &&
      producer.attr().count("dtype")) {
    const tensorflow::PartialTensorShape shape(producer.attr().at("shape").shape());
    const int64_t element = tensorflow::DataTypeSize(producer.attr().at("dtype").type());
    if (shape.IsFullyDefined() && element > 0) return shape.num_elements() * element;
  }
  for (int consumer : table.tensors[handle_tensor].consumers) {
    const NodeDef& node = *table.nodes[consumer].def;
    const std::vector<OpInfo::TensorProperties>* shapes = nullptr;
    int index = 0;
    if (node.op() == "ReadVariableOp") {
      shapes = &props.GetOutputProperties(node.name());
    } else if (node.op() == "AssignVariableOp" ||
               node.op() == "AssignAddVariableOp" ||
               node.op() == "AssignSubVariableOp") {
      shapes = &props.GetInputProperties(node.name());
      index = 1;
    }
    if (shapes == nullptr || static_cast<int>(shapes->size()) <= index) continue;
    ShapeBytes size = SizeOf((*shapes)[index], {}, 0);
    if (size.known) return size.bytes;
  }
  return 0;
}

// The softmax cross-entropy kernels, whose backprop may take the logits' buffer.
bool IsSoftmaxCrossEntropy(const NodeDef& node) {
  return node.op() == "SparseSoftmaxCrossEntropyWithLogits" ||
         node.op() == "SoftmaxCrossEntropyWithLogits";
}

// The output that ReusableInputPorts' inputs may be forwarded to.
int ReusingOutput(const NodeDef& node) { return IsSoftmaxCrossEntropy(node) ? 1 : 0; }

// Inputs whose buffer the kernel may take over for an output (ReusingOutput) (TF's
// forward_input_or_allocate_output): element-wise kernels (UnaryOp and BinaryOp
// in cwise_ops_common.h, UnaryElementWiseOp and BinaryElementWiseOp in
// numeric_op.h, SimpleBinaryOp), BiasAdd (its input) and AddN (any input).
// Measured on the five benchmark models (TF 2.21, oneDNN on): such outputs
// allocate nothing whenever their input had no other reader left. So do Softmax
// and LogSoftmax (softmax_op.h), ClipByValue (its input), Select and SelectV2 (their
// "t" or "e" input, cwise_op_select.cc), measured one op at a time; and the softmax
// cross-entropy kernels (sparse_xent_op.cc, xent_op.cc) forward the logits (input
// 0) to their backprop (output 1, ReusingOutput).
std::vector<int> ReusableInputPorts(const NodeDef& node) {
  static const auto* unary = new std::set<std::string>{
      "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh",
      "Elu", "Erf", "Erfc", "Exp", "Expm1", "Floor", "Inv", "Invert", "LeakyRelu",
      "Log", "Log1p", "LogicalNot", "Neg", "Reciprocal", "Relu", "Relu6", "Rint",
      "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
      "Softsign", "Sqrt", "Square", "Tan", "Tanh"};
  static const auto* binary = new std::set<std::string>{
      "Add", "AddV2", "Atan2", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div",
      "DivNoNan", "FloorDiv", "FloorMod", "LogicalAnd", "LogicalOr", "Maximum",
      "Minimum", "Mod", "Mul", "MulNoNan", "Pow", "RealDiv", "SquaredDifference",
      "Sub", "TruncateDiv", "TruncateMod", "Xdivy", "Xlogy",
      // Gradients of activations (BinaryElementWiseOp, SimpleBinaryOp).
      "EluGrad", "InvGrad", "LeakyReluGrad", "ReciprocalGrad", "Relu6Grad",
      "ReluGrad", "RsqrtGrad", "SeluGrad", "SigmoidGrad", "SoftplusGrad",
      "SoftsignGrad", "SqrtGrad", "TanhGrad"};
  if (unary->count(node.op()) || node.op() == "BiasAdd" || node.op() == "Softmax" ||
      node.op() == "LogSoftmax" || node.op() == "ClipByValue" || IsSoftmaxCrossEntropy(node)) {
    return {0};
  }
  if (node.op() == "Select" || node.op() == "SelectV2") return {1, 2};
  if (binary->count(node.op())) return {0, 1};
  if (node.op() == "AddN") {
    std::vector<int> all;
    for (int i = 0; i < node.input_size(); ++i) {
      if (!absl::StartsWith(node.input(i), "^")) all.push_back(static_cast<int>(all.size()));
    }
    return all;
  }
  return {};
}

void BindReusableInputs(TensorTable* table) {
  for (NodeInfo& node : table->nodes) {
    node.reusable_output = ReusingOutput(*node.def);
    if (static_cast<int>(node.outputs.size()) <= node.reusable_output) continue;
    const TensorInfo& out = table->tensors[node.outputs[node.reusable_output]];
    if (!out.size_known || out.bytes == 0) continue;
    for (int port : ReusableInputPorts(*node.def)) {
      if (port >= static_cast<int>(node.inputs.size())) continue;
      const TensorInfo& in = table->tensors[node.inputs[port]];
      if (in.size_known && in.dtype == out.dtype && in.bytes == out.bytes) {
        node.reusable_inputs.push_back(port);
      }
    }
  }
}

// Resource inputs that the kernel updates in place: the Assign*VariableOp family
// and the Resource(Sparse)Apply* training ops (PrepareToUpdateVariable copies the
// variable when its buffer is shared), and the ResourceScatter* ops. Reference
// variables' updates (Assign, Apply*, Scatter*) change the buffer in place, copy
// nothing, and are only marked as updates.
void BindUpdatedVariables(TensorTable* table) {
  for (NodeInfo& node : table->nodes) {
    const std::string& op = node.def->op();
    const bool assign = op == "AssignVariableOp" || op == "AssignAddVariableOp" ||
                        op == "AssignSubVariableOp" ||
                        absl::StartsWith(op, "ResourceScatter");
    const bool apply = absl::StartsWith(op, "ResourceApply") ||
                       absl::StartsWith(op, "ResourceSparseApply");
    if (!assign && !apply) {
      // A reference variable's update takes it as input 0, by reference.
      node.updates_variable = !node.inputs.empty() &&
                              tensorflow::IsRefType(table->tensors[node.inputs[0]].dtype) &&
                              ForwardedInput(*node.def, 0) == 0 && op != "RefIdentity";
      continue;
    }
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      if (table->tensors[node.inputs[i]].dtype != tensorflow::DT_RESOURCE) continue;
      node.updated_variables.push_back(static_cast<int>(i));
      if (assign) break;  // only the first input is the variable
    }
    node.updates_variable = !node.updated_variables.empty();
  }
}

// A variable the step updates whose initial value a Const of the initializer's
// graph still holds (analyze/initial_values.h): after the first step the device
// holds both, so the initial value is one more persistent buffer, one per Const
// however many variables shared it. Needs BindUpdatedVariables.
void AddHeldInitialValues(TensorTable* table) {
  std::vector<bool> updated(table->tensors.size(), false);
  for (const NodeInfo& node : table->nodes) {
    for (int port : node.updated_variables) {
      // The handle, through the Identities a Session graph may read it by.
      int t = node.inputs[port];
      for (int hops = 0; hops < 8; ++hops) {
        const NodeInfo& producer = table->nodes[table->tensors[t].node];
        if (producer.def->op() != "Identity" || producer.inputs.empty()) break;
        t = producer.inputs[0];
      }
      updated[t] = true;
    }
  }
  absl::flat_hash_set<std::string> consts;
  for (size_t t = 0; t < table->tensors.size(); ++t) {
    if (!updated[t]) continue;
    const TensorInfo& handle = table->tensors[t];
    const HeldInitialValue value = HeldInitialValueOf(*table->nodes[handle.node].def);
    if (value.bytes <= 0 || handle.buffer < 0 || !consts.insert(value.id).second) continue;
    BufferInfo held;
    held.owner = static_cast<int>(t);
    held.bytes = value.bytes;
    held.persistent = true;
    held.device = table->buffers[handle.buffer].device;
    table->buffers.push_back(held);
  }
}

// Sets TensorTable::variables_made_by_recorded_initializer.
void NoteVariablesMadeByRecordedInitializer(TensorTable* table) {
  int variables = 0;
  bool recorded = true;
  for (const NodeInfo& node : table->nodes) {
    const std::string& op = node.def->op();
    if (op == "VarHandleOp") {
      ++variables;
      recorded = recorded && InitializedByRecordedGraph(*node.def);
    } else if (op == "VariableV2" || op == "Variable") {
      recorded = false;  // a reference variable, assigned by no recorded graph
    } else if ((op == "_Arg" || op == "Placeholder") && !node.outputs.empty() &&
               table->tensors[node.outputs[0]].dtype == tensorflow::DT_RESOURCE) {
      recorded = false;  // a handle the caller passes: made elsewhere
    }
  }
  table->variables_made_by_recorded_initializer = variables > 0 && recorded;
}

bool IsListCreator(const NodeDef& node) {
  return node.op() == "EmptyTensorList" || node.op() == "TensorListReserve";
}

// A TensorList is a variant, so shape inference gives it no size. A freshly
// created list holds nothing yet; TensorListFromTensor holds a copy of its input.
// What loops push into lists is sized per list instance (see BindLoopLists).
void SizeTensorLists(TensorTable* table) {
  for (NodeInfo& node : table->nodes) {
    if (node.outputs.empty() || node.inputs.empty()) continue;
    TensorInfo& list = table->tensors[node.outputs[0]];
    if (node.def->op() == "TensorListFromTensor") {
      const TensorInfo& source = table->tensors[node.inputs[0]];
      list.bytes = source.bytes;
      list.size_known = source.size_known;
    } else if (IsListCreator(*node.def)) {
      list.bytes = 0;
      list.size_known = true;
    }
  }
}

// The Enter that brings a freshly created list into a loop frame is where one
// list instance begins: Grappler's CSE often lets several accumulators share one
// EmptyTensorList, and TF copies a shared list on its first push, so each Enter
// holds a list of its own.
bool StartsListInstance(const TensorTable& table, const NodeInfo& node) {
  if (node.def->op() != "Enter" || node.inputs.empty()) return false;
  return IsListCreator(*table.nodes[table.tensors[node.inputs[0]].node].def);
}

// Sizes each list instance a loop fills (LoopAnalysis) as capacity x the bytes of
// the item pushed into it, in `pieces` of one item each (TF allocates every
// element on its own). An item pushed as is holds no memory of its own when it is
// a variable read or a constant (the list references their buffer) or an element
// of another list, whose buffer the instance then holds until it is freed itself;
// a loop-carried item is new in every iteration, whatever its first value was.
// Items swapped out (TfMemSwapOut) are held in host memory. Elements popped back
// (TensorListPopBack, port 1) are the pushed items. Instances whose capacity or
// item size is unknown stay unresolved.
void BindLoopLists(TensorTable* table) {
  std::vector<std::vector<int>> tensors_of_buffer(table->buffers.size());
  for (size_t t = 0; t < table->tensors.size(); ++t) {
    tensors_of_buffer[table->tensors[t].buffer].push_back(static_cast<int>(t));
  }
  for (const ListInstance& list : table->loops.lists) {
    if (list.item < 0) continue;  // filled by no write in its loop: holds nothing
    BufferInfo& buffer = table->buffers[list.buffer];
    const TensorInfo& item = table->tensors[list.item];
    const bool known = list.capacity >= 0 && item.size_known;
    const int64_t bytes = known && !list.referenced ? list.capacity * item.bytes : 0;
    const bool host = table->nodes[item.node].def->op() == kSwappedOutOp;
    buffer.bytes = host ? 0 : bytes;
    buffer.host_bytes = host ? bytes : 0;
    buffer.pieces = std::max<int64_t>(list.capacity, 1);
    buffer.allocated_by = list.pushes.empty() ? -1 : list.pushes.front();
    buffer.drained_by = list.pops.empty() ? -1 : list.pops.front();
    if (list.referenced && !table->buffers[item.buffer].persistent &&
        item.buffer != list.buffer) {
      table->buffers[item.buffer].held_by.push_back(list.buffer);
    }
    for (int t : tensors_of_buffer[list.buffer]) {
      TensorInfo& tensor = table->tensors[t];
      if (tensor.dtype == tensorflow::DT_VARIANT) {
        tensor.size_known = known;
        tensor.bytes = t == buffer.owner ? bytes : 0;
      }
    }
    for (int pop : list.pops) {
      const NodeInfo& node = table->nodes[pop];
      if (node.outputs.size() < 2) continue;
      TensorInfo& element = table->tensors[node.outputs[1]];
      element.bytes = item.bytes;
      element.size_known = item.size_known;
    }
  }
}

// ZerosLike of a TensorList (TensorListZerosLike: the gradient's initial value for
// a list a loop carries) allocates a zero tensor on the device for every element
// of its input, wherever that input's elements are.
void SizeZerosLikeLists(TensorTable* table) {
  for (const NodeInfo& node : table->nodes) {
    if (node.def->op() != "ZerosLike" || node.inputs.empty() || node.outputs.empty()) continue;
    const TensorInfo& input = table->tensors[node.inputs[0]];
    TensorInfo& output = table->tensors[node.outputs[0]];
    if (input.dtype != tensorflow::DT_VARIANT || output.buffer < 0) continue;
    const BufferInfo& source = table->buffers[input.buffer];
    BufferInfo& buffer = table->buffers[output.buffer];
    if (buffer.owner != node.outputs[0]) continue;
    buffer.bytes = source.bytes + source.host_bytes;
    buffer.pieces = source.pieces;
    output.bytes = buffer.bytes;
    output.size_known = table->tensors[source.owner].size_known;
  }
}

}  // namespace

const char* TensorRoleName(TensorRole role) {
  switch (role) {
    case TensorRole::kPersistent: return "persistent";
    case TensorRole::kActivation: return "activation";
    case TensorRole::kGradient: return "gradient";
  }
  return "unknown";
}

std::string ShortDeviceName(const std::string& device) {
  tensorflow::DeviceNameUtils::ParsedName parsed;
  if (device.empty() ||
      !tensorflow::DeviceNameUtils::ParseFullName(device, &parsed) ||
      !parsed.has_type || !parsed.has_id) {
    return device;
  }
  return absl::StrCat(parsed.type, ":", parsed.id);
}

int64_t AllocatedOutputBytes(const TensorTable& table, int n) {
  int64_t bytes = 0;
  for (int t : table.nodes[n].outputs) {
    const int b = table.tensors[t].buffer;
    if (b >= 0 && table.buffers[b].owner == t && !table.buffers[b].persistent) {
      bytes += table.buffers[b].bytes;
    }
  }
  return bytes;
}

bool ReadsShapeOnly(const std::string& op) {
  return op == "Shape" || op == "ShapeN" || op == "Size" || op == "Rank";
}

bool IsReturnValue(const tensorflow::NodeDef& def) {
  return tensorflow::grappler::IsRetval(def) || def.op() == "_DeviceRetval";
}

std::string TensorTable::TensorName(int tensor) const {
  const TensorInfo& t = tensors[tensor];
  const std::string& node = nodes[t.node].def->name();
  return t.port == 0 ? node : absl::StrCat(node, ":", t.port);
}

namespace {

// TF's classic constant folding (common_runtime/constant_folding.cc) runs again
// after Grappler, when a Session partitions its graph and when a function is
// instantiated (GraphOptimizer at opt_level L1, the default). It folds what
// Grappler's own constant folding leaves because Grappler does not materialize
// constants above 100 KB: for example the gradient of a reduce_sum, a Tile of the
// constant seed to the input's shape. A node is foldable when it is not stateful,
// not control flow, not a Send/Recv and not a function call, and all its data
// inputs are foldable (control inputs do not matter); graph inputs are not
// (Placeholder becomes _Arg/_Recv, which are stateful). Each foldable output that
// a non-foldable node reads is replaced by a Const holding it, unless it is over
// max_constant_size_in_bytes (10 MiB), in which case its node stays. Measured on
// a v1 Session chain of 100 tanh over 1 MB tensors (tests/test_memory_model.py):
// the folded Tile of the loss's gradient is a constant, so the first TanhGrad
// cannot take over its buffer and allocates its own.
void MarkRuntimeFoldedConstants(TensorTable* table) {
  constexpr int64_t kMaxFoldedConstantBytes = int64_t{10} << 20;
  const int n = static_cast<int>(table->nodes.size());
  auto can_fold_op = [&](const NodeDef& node) {
    if (tensorflow::grappler::IsConstant(node)) return true;
    if (IsGraphInput(node) || tensorflow::grappler::IsControlFlow(node) ||
        tensorflow::grappler::IsSend(node) || tensorflow::grappler::IsRecv(node)) {
      return false;
    }
    const tensorflow::OpDef* op_def = nullptr;
    if (!tensorflow::OpRegistry::Global()->LookUpOpDef(node.op(), &op_def).ok()) {
      return false;  // a function call: TF does not fold those
    }
    return !op_def->is_stateful() && !node.attr().count("_scoped_allocator");
  };
  // Kahn's order over data edges; nodes on cycles (loops) are never foldable.
  std::vector<int> pending(n, 0);
  std::vector<std::vector<int>> readers(n);
  for (int i = 0; i < n; ++i) {
    for (int t : table->nodes[i].inputs) {
      ++pending[i];
      readers[table->tensors[t].node].push_back(i);
    }
  }
  std::vector<bool> foldable(n, false);
  std::deque<int> ready;
  for (int i = 0; i < n; ++i) {
    if (pending[i] == 0) ready.push_back(i);
  }
  while (!ready.empty()) {
    const int i = ready.front();
    ready.pop_front();
    const NodeInfo& node = table->nodes[i];
    bool inputs_constant = true;
    for (int t : node.inputs) inputs_constant &= foldable[table->tensors[t].node];
    bool resource_output = false;
    for (int t : node.outputs) {
      resource_output |= table->tensors[t].dtype == tensorflow::DT_RESOURCE;
    }
    foldable[i] = inputs_constant && !resource_output && can_fold_op(*node.def);
    for (int r : readers[i]) {
      if (--pending[r] == 0) ready.push_back(r);
    }
  }
  // An output over the size limit is not replaced: its node keeps running, and
  // then so do the foldable nodes it reads (their outputs get replaced instead).
  auto read_outside = [&](int t) {
    for (int c : table->tensors[t].consumers) {
      if (!foldable[c]) return true;
    }
    return false;
  };
  bool changed = true;
  while (changed) {
    changed = false;
    for (int i = 0; i < n; ++i) {
      if (!foldable[i] || tensorflow::grappler::IsConstant(*table->nodes[i].def)) continue;
      for (int t : table->nodes[i].outputs) {
        const TensorInfo& tensor = table->tensors[t];
        if (read_outside(t) && (!tensor.size_known || tensor.bytes > kMaxFoldedConstantBytes)) {
          foldable[i] = false;
          changed = true;
          break;
        }
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    if (!foldable[i] || tensorflow::grappler::IsConstant(*table->nodes[i].def)) continue;
    for (int t : table->nodes[i].outputs) {
      table->tensors[t].folding = read_outside(t) ? TensorInfo::Folding::kConstant
                                                  : TensorInfo::Folding::kIntermediate;
    }
  }
}

absl::Status InferShapes(GraphProperties* properties) {
  absl::Status status = properties->InferStatically(
      /*assume_valid_feeds=*/true, /*aggressive_shape_inference=*/false,
      /*include_input_tensor_values=*/false,
      /*include_output_tensor_values=*/false);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("shape inference: ", status.message()));
  }
  return absl::OkStatus();
}

// The table of `item`, with shapes from `properties`: inferred on `item` or on a
// copy of it whose nodes have the same names. `library`: the functions, with the
// bodies of stubs filled in (FillFunctionBodies).
absl::Status BuildFromProperties(const GrapplerItem& item,
                                 const GraphProperties& properties,
                                 const tensorflow::FunctionDefLibrary& library,
                                 const MemoryOptimizerOptions& options,
                                 TensorTable* table) {
  *table = TensorTable();
  const tensorflow::GraphDef& graph = item.graph;

  // The batch dimension: the symbolic dim 0 of every graph input.
  std::set<int64_t> batch_symbols;
  std::set<std::string> feeds;
  for (const auto& feed : item.feed) {
    feeds.insert(tensorflow::grappler::NodeName(feed.first));
  }
  for (const NodeDef& node : graph.node()) {
    if (!IsBatchSource(node) && !feeds.count(node.name())) continue;
    if (!properties.HasOutputProperties(node.name())) continue;
    for (const auto& out : properties.GetOutputProperties(node.name())) {
      if (out.shape().unknown_rank() || out.shape().dim_size() == 0) continue;
      int64_t dim0 = out.shape().dim(0).size();
      if (dim0 < -1) batch_symbols.insert(dim0);
    }
  }

  std::set<std::string> devices;
  table->nodes.resize(graph.node_size());
  for (int i = 0; i < graph.node_size(); ++i) {
    const NodeDef& node = graph.node(i);
    NodeInfo& info = table->nodes[i];
    info.def = &node;
    info.device = ShortDeviceName(node.device());
    devices.insert(info.device);
    info.stateful = tensorflow::grappler::IsStateful(node);
    table->node_index[node.name()] = i;
    if (!properties.HasOutputProperties(node.name())) continue;
    const auto& outputs = properties.GetOutputProperties(node.name());
    for (int port = 0; port < static_cast<int>(outputs.size()); ++port) {
      ShapeBytes size = SizeOf(outputs[port], batch_symbols, options.assume_batch_size);
      // A shape vector is as long as a rank: a few bytes, whether or not shape
      // inference knows that rank. Counting it as unknown would only ask the user
      // for an assume_batch_size that changes nothing (and leave unsized the lists a
      // loop fills with such vectors for its gradient).
      if (!size.known && IsShapeMetadataOp(node.op()) &&
          tensorflow::DataTypeIsInteger(outputs[port].dtype())) {
        size.known = true;
      }
      TensorInfo tensor;
      tensor.node = i;
      tensor.port = port;
      tensor.bytes = size.bytes;
      tensor.dtype = outputs[port].dtype();
      tensor.size_known = size.known;
      table->batch_dims_resolved += size.resolved_dims;
      table->batch_dims_assumed += size.assumed_dims;
      info.outputs.push_back(static_cast<int>(table->tensors.size()));
      table->tensors.push_back(tensor);
    }
  }
  table->devices.assign(devices.begin(), devices.end());

  // Data edges. A producer port past what shape inference reported gets a row of
  // its own (unknown size) so that no edge is lost.
  for (int i = 0; i < graph.node_size(); ++i) {
    const NodeDef& node = graph.node(i);
    for (const std::string& input : node.input()) {
      tensorflow::TensorId id = tensorflow::ParseTensorName(input);
      auto it = table->node_index.find(std::string(id.node()));
      if (it == table->node_index.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "node ", node.name(), " reads missing input ", input));
      }
      if (id.index() < 0) {  // control dependency
        table->nodes[i].control_inputs.push_back(it->second);
        continue;
      }
      NodeInfo& producer = table->nodes[it->second];
      while (static_cast<int>(producer.outputs.size()) <= id.index()) {
        TensorInfo tensor;
        tensor.node = it->second;
        tensor.port = static_cast<int>(producer.outputs.size());
        tensor.size_known = false;
        producer.outputs.push_back(static_cast<int>(table->tensors.size()));
        table->tensors.push_back(tensor);
      }
      int tensor = producer.outputs[id.index()];
      table->tensors[tensor].consumers.push_back(i);
      table->nodes[i].inputs.push_back(tensor);
    }
  }
  for (const std::string& fetch : item.fetch) {
    tensorflow::TensorId id = tensorflow::ParseTensorName(fetch);
    auto it = table->node_index.find(std::string(id.node()));
    if (it == table->node_index.end()) continue;
    const NodeInfo& node = table->nodes[it->second];
    if (id.index() >= 0 && id.index() < static_cast<int>(node.outputs.size())) {
      table->fetch_tensors.push_back(node.outputs[id.index()]);
    }
  }

  SizeTensorLists(table);
  EstimateKernelScratch(properties, library, table);
  EstimateComputeSeconds(properties, table);

  // Backward = in a gradient scope or downstream of one, along data edges. Nodes
  // that only hand out metadata or persistent memory neither start nor pass it on:
  // after Grappler's deduplication one variable read or constant often serves both
  // passes under a "gradient_tape/" name, and following it (or control edges, which
  // order the optimizer update after everything) would mark the forward pass too.
  auto neutral = [](const NodeDef& node) {
    static const auto* ops = new std::set<std::string>{
        "ReadVariableOp", "Const", "HostConst", "VarHandleOp", "_Arg", "Placeholder",
        "Shape", "ShapeN", "Size", "Rank", "NoOp"};
    return ops->count(node.op()) > 0;
  };
  std::deque<int> frontier;
  for (int i = 0; i < graph.node_size(); ++i) {
    if (InGradientScope(graph.node(i).name()) && !neutral(graph.node(i))) {
      table->nodes[i].backward = true;
      frontier.push_back(i);
    }
  }
  while (!frontier.empty()) {
    const int n = frontier.front();
    frontier.pop_front();
    for (int t : table->nodes[n].outputs) {
      for (int next : table->tensors[t].consumers) {
        if (table->nodes[next].backward || neutral(graph.node(next))) continue;
        table->nodes[next].backward = true;
        frontier.push_back(next);
      }
    }
  }

  // Buffers: forwarding ops share their input's buffer; variables and constants
  // live for the whole step.
  MarkRuntimeFoldedConstants(table);
  std::vector<bool> views(graph.node_size(), false);
  for (int i = 0; i < graph.node_size(); ++i) views[i] = SliceIsView(graph.node(i), properties);
  for (int i = 0; i < graph.node_size(); ++i) {
    for (int t : table->nodes[i].outputs) {
      TensorInfo& tensor = table->tensors[t];
      NodeInfo& node = table->nodes[i];
      tensor.role = node.backward ? TensorRole::kGradient : TensorRole::kActivation;
      if (tensor.folding != TensorInfo::Folding::kNone) {
        BufferInfo buffer;
        buffer.owner = t;
        buffer.device = node.device;
        buffer.bytes = tensor.folding == TensorInfo::Folding::kConstant ? tensor.bytes : 0;
        buffer.persistent = true;
        tensor.role = TensorRole::kPersistent;
        tensor.buffer = static_cast<int>(table->buffers.size());
        table->buffers.push_back(buffer);
        continue;
      }
      const int source = views[i] && tensor.port == 0 ? 0 : ForwardedInput(*node.def, tensor.port);
      if (source >= 0 && source < static_cast<int>(node.inputs.size()) &&
          !StartsListInstance(*table, node) && SameDeviceAsInput(*table, node, source)) {
        continue;  // bound below, once its input's buffer exists
      }
      BufferInfo buffer;
      buffer.owner = t;
      buffer.device = node.device;
      if (tensor.dtype == tensorflow::DT_RESOURCE) {
        buffer.bytes = VariableBytes(*table, properties, t);
        buffer.persistent = true;
        tensor.role = TensorRole::kPersistent;
      } else if (node.def->op() == kSwappedOutOp) {
        buffer.host_bytes = tensor.bytes;  // the swap-out's stash lives in the host pool
      } else {
        buffer.bytes = tensor.bytes;
        buffer.persistent = IsPersistentProducer(*node.def);
        if (buffer.persistent) tensor.role = TensorRole::kPersistent;
        // PlaceholderWithDefault hands out its default unless it is fed.
        buffer.external = node.def->op() == "_Arg" || node.def->op() == "Placeholder" ||
                          feeds.count(node.def->name()) > 0;
      }
      tensor.buffer = static_cast<int>(table->buffers.size());
      table->buffers.push_back(buffer);
    }
  }
  // Forwarded outputs, resolved along a topological walk of the alias chains.
  bool changed = true;
  while (changed) {
    changed = false;
    for (size_t i = 0; i < table->nodes.size(); ++i) {
      NodeInfo& node = table->nodes[i];
      if (!views[i] && !ForwardsInputBuffer(*node.def)) continue;
      for (int t : node.outputs) {
        TensorInfo& tensor = table->tensors[t];
        const int port = StartsListInstance(*table, node) ? -1
                         : views[i] && tensor.port == 0  ? 0
                                                          : ForwardedInput(*node.def, tensor.port);
        if (tensor.buffer >= 0 || port < 0 || port >= static_cast<int>(node.inputs.size()) ||
            !SameDeviceAsInput(*table, node, port)) {
          continue;
        }
        const TensorInfo& source = table->tensors[node.inputs[port]];
        if (source.buffer < 0) continue;
        tensor.buffer = source.buffer;
        if (table->buffers[source.buffer].persistent) tensor.role = TensorRole::kPersistent;
        changed = true;
      }
    }
  }
  for (TensorInfo& tensor : table->tensors) {
    if (tensor.buffer >= 0) continue;  // only alias cycles remain here
    BufferInfo buffer;
    buffer.owner = static_cast<int>(&tensor - table->tensors.data());
    buffer.bytes = tensor.bytes;
    buffer.device = table->nodes[tensor.node].device;
    tensor.buffer = static_cast<int>(table->buffers.size());
    table->buffers.push_back(buffer);
  }
  absl::Status loops = AnalyzeLoops(graph, *table, options.assume_trip_count, &table->loops);
  if (!loops.ok()) return loops;
  BindLoopLists(table);
  SizeZerosLikeLists(table);
  // A variant passed along (a list through a loop's plumbing) is the buffer of
  // the one it aliases, sized above if that one is.
  for (size_t t = 0; t < table->tensors.size(); ++t) {
    TensorInfo& tensor = table->tensors[t];
    const int owner = table->buffers[tensor.buffer].owner;
    if (tensor.dtype == tensorflow::DT_VARIANT && !tensor.size_known &&
        owner != static_cast<int>(t) && table->tensors[owner].dtype == tensorflow::DT_VARIANT &&
        table->tensors[owner].size_known) {
      tensor.size_known = true;
    }
  }
  BindReusableInputs(table);
  BindUpdatedVariables(table);
  AddHeldInitialValues(table);
  NoteVariablesMadeByRecordedInitializer(table);
  AddKernelBuffers(table);
  for (size_t t = 0; t < table->tensors.size(); ++t) {
    if (!table->tensors[t].size_known) {
      table->unresolved_tensors.push_back(t);
      VLOG(2) << "unresolved " << table->TensorName(t) << " ("
              << table->nodes[table->tensors[t].node].def->op() << ", "
              << tensorflow::DataTypeString(table->tensors[t].dtype) << ", "
              << table->tensors[t].bytes << " bytes)";
    }
  }
  return absl::OkStatus();
}

// An int32 vector constant.
NodeDef ShapeConst(const std::string& name, const std::string& device,
                   const tensorflow::TensorShapeProto& shape) {
  NodeDef node;
  node.set_name(name);
  node.set_op("Const");
  node.set_device(device);
  (*node.mutable_attr())["dtype"].set_type(tensorflow::DT_INT32);
  tensorflow::TensorProto* value = (*node.mutable_attr())["value"].mutable_tensor();
  value->set_dtype(tensorflow::DT_INT32);
  value->mutable_tensor_shape()->add_dim()->set_size(shape.dim_size());
  for (const auto& dim : shape.dim()) value->add_int_val(static_cast<int32_t>(dim.size()));
  return node;
}

bool FullyDefined(const tensorflow::TensorShapeProto& shape) {
  if (shape.unknown_rank()) return false;
  for (const auto& dim : shape.dim()) {
    if (dim.size() < 0) return false;
  }
  return true;
}

const tensorflow::TensorShapeProto* OutputShape(const GraphProperties& properties,
                                                const TensorTable& table, int tensor) {
  const TensorInfo& t = table.tensors[tensor];
  const std::string& name = table.nodes[t.node].def->name();
  if (!properties.HasOutputProperties(name)) return nullptr;
  const auto& outputs = properties.GetOutputProperties(name);
  if (t.port >= static_cast<int>(outputs.size())) return nullptr;
  return &outputs[t.port].shape();
}

// The shape of the variable behind resource tensor `handle`: from the handle's
// producer (a VarHandleOp's shape, a function argument's _handle_shapes), else as
// a ReadVariableOp of it sees it (also through the Enter nodes that bring the
// handle into a loop). Null if none is fully defined.
const tensorflow::TensorShapeProto* VariableShapeOf(const TensorTable& table,
                                                   const GraphProperties& properties,
                                                   int handle) {
  const NodeDef& producer = *table.nodes[table.tensors[handle].node].def;
  for (const char* attr : {"shape", "_handle_shapes"}) {
    if (!producer.attr().count(attr)) continue;
    const tensorflow::AttrValue& value = producer.attr().at(attr);
    const tensorflow::TensorShapeProto* shape =
        value.has_shape() ? &value.shape()
        : value.list().shape_size() == 1 ? &value.list().shape(0)
                                          : nullptr;
    if (shape != nullptr && FullyDefined(*shape)) return shape;
  }
  std::vector<int> handles = {handle};
  for (size_t i = 0; i < handles.size() && i < 64; ++i) {
    for (int reader : table.tensors[handles[i]].consumers) {
      const NodeInfo& node = table.nodes[reader];
      if (node.def->op() == "Enter" || node.def->op() == "Identity") {
        handles.insert(handles.end(), node.outputs.begin(), node.outputs.begin() + 1);
        continue;
      }
      if (node.def->op() != "ReadVariableOp") continue;
      const tensorflow::TensorShapeProto* shape = OutputShape(properties, table, node.outputs[0]);
      if (shape != nullptr && FullyDefined(*shape)) return shape;
    }
  }
  return nullptr;
}

// Shape inference does not evaluate VariableShape, so the zero-filled gradient
// accumulators of a loop (Fill(VariableShape(v), 0)) and everything computed
// from them stay unknown (30 tensors of the benchmark LSTM). In a copy of the
// graph such VariableShapes become constants of the variable's shape.
//
// Nor does it follow a TensorList through a loop's Exit into the gradient loop, so
// what TensorListPopBack gives back there, and everything the gradient loop
// computes from it, has no shape (about 70 tensors of a two-layer GRU). The
// element is the item the forward loop pushed (LoopAnalysis): in the copy, the
// PopBack's element_shape input becomes a constant of that item's shape.
//
// Returns false if neither applies.
bool RefineShapes(const GrapplerItem& item, const TensorTable& table,
                  const GraphProperties& properties, GrapplerItem* copy) {
  tensorflow::GraphDef graph = item.graph;
  bool changed = false;
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    const NodeInfo& node = table.nodes[n];
    if (node.def->op() != "VariableShape" || node.inputs.empty()) continue;
    if (node.def->attr().count("out_type") &&
        node.def->attr().at("out_type").type() != tensorflow::DT_INT32) {
      continue;
    }
    const tensorflow::TensorShapeProto* value = VariableShapeOf(table, properties, node.inputs[0]);
    if (value == nullptr) continue;
    NodeDef constant = ShapeConst(node.def->name(), node.def->device(), *value);
    constant.add_input(absl::StrCat("^", tensorflow::grappler::NodeName(node.def->input(0))));
    *graph.mutable_node(n) = constant;
    changed = true;
  }
  // The element shape of each list buffer: the item a loop pushes, or the rows of
  // the tensor TensorListFromTensor was made from.
  absl::flat_hash_map<int, tensorflow::TensorShapeProto> element_of_buffer;
  for (const ListInstance& list : table.loops.lists) {
    if (list.item < 0) continue;
    const tensorflow::TensorShapeProto* shape = OutputShape(properties, table, list.item);
    if (shape != nullptr && FullyDefined(*shape)) element_of_buffer[list.buffer] = *shape;
  }
  for (const NodeInfo& node : table.nodes) {
    if (node.def->op() != "TensorListFromTensor" || node.inputs.empty() || node.outputs.empty()) {
      continue;
    }
    const tensorflow::TensorShapeProto* shape = OutputShape(properties, table, node.inputs[0]);
    if (shape == nullptr || !FullyDefined(*shape) || shape->dim_size() < 1) continue;
    tensorflow::TensorShapeProto rows;
    for (int d = 1; d < shape->dim_size(); ++d) *rows.add_dim() = shape->dim(d);
    element_of_buffer[table.tensors[node.outputs[0]].buffer] = rows;
  }
  for (size_t n = 0; n < table.nodes.size(); ++n) {
    const NodeInfo& node = table.nodes[n];
    const std::string& op = node.def->op();
    const int port = op == "TensorListPopBack" ? 1 : op == "TensorListGetItem" ? 0 : -1;
    if (port < 0 || node.inputs.empty() || static_cast<int>(node.outputs.size()) <= port) continue;
    auto it = element_of_buffer.find(table.tensors[node.inputs[0]].buffer);
    if (it == element_of_buffer.end()) continue;
    const int element = node.outputs[port];
    const tensorflow::TensorShapeProto* known = OutputShape(properties, table, element);
    if (known != nullptr && FullyDefined(*known)) continue;
    // PopBack's shape function reads only the list's handle data, which does not
    // survive a loop's plumbing; its readers read an EnsureShape of the element
    // instead (in the copy only).
    const std::string ref = table.TensorName(element);
    NodeDef ensure;
    ensure.set_name(absl::StrCat(node.def->name(), "/_tfmemopt_element_", port));
    ensure.set_op("EnsureShape");
    ensure.set_device(node.def->device());
    ensure.add_input(ref);
    (*ensure.mutable_attr())["shape"].mutable_shape()->CopyFrom(it->second);
    (*ensure.mutable_attr())["T"].set_type(table.tensors[element].dtype);
    for (int consumer : table.tensors[element].consumers) {
      NodeDef* reader = graph.mutable_node(consumer);
      for (int i = 0; i < reader->input_size(); ++i) {
        if (reader->input(i) == ref || (port == 0 && reader->input(i) == ref + ":0")) {
          reader->set_input(i, ensure.name());
        }
      }
    }
    *graph.add_node() = std::move(ensure);
    changed = true;
  }
  if (!changed) return false;
  *copy = item.WithGraph(std::move(graph));
  return true;
}

}  // namespace

absl::Status BuildTensorTable(const GrapplerItem& item,
                              const MemoryOptimizerOptions& options,
                              TensorTable* table) {
  // Functions the item has as stubs (function_bodies.h) get their bodies back in a
  // copy, so that shape inference sees through their calls (GraphProperties'
  // UpdateFunction) and the kernel-memory model sees what XLA compiles.
  GrapplerItem with_bodies;
  const GrapplerItem* inferred = &item;
  if (HasStubFunctions(item.graph)) {  // the copy only where a body is missing
    tensorflow::GraphDef graph = item.graph;
    if (FillFunctionBodies(&graph)) {
      with_bodies = item.WithGraph(std::move(graph));
      inferred = &with_bodies;
    }
  }
  auto properties = std::make_unique<GraphProperties>(*inferred);
  absl::Status status = InferShapes(properties.get());
  if (!status.ok() && inferred != &item) {
    // A body shape inference cannot take: the item as Grappler gave it, stubs and all.
    VLOG(1) << "TfMemOpt: shape inference with function bodies failed (" << status.message()
            << "); inferring without them";
    inferred = &item;
    properties = std::make_unique<GraphProperties>(item);
    status = InferShapes(properties.get());
  }
  if (!status.ok()) return status;
  const tensorflow::FunctionDefLibrary& library = inferred->graph.library();
  status = BuildFromProperties(item, *properties, library, options, table);
  if (!status.ok() || table->unresolved_tensors.empty()) return status;
  GrapplerItem copy;
  if (!RefineShapes(*inferred, *table, *properties, &copy)) return absl::OkStatus();
  GraphProperties refined(copy);
  status = InferShapes(&refined);
  if (!status.ok()) {
    VLOG(1) << "TfMemOpt: refined shape inference failed: " << status.message();
    return absl::OkStatus();
  }
  TensorTable second;
  status = BuildFromProperties(item, refined, library, options, &second);
  VLOG(1) << "TfMemOpt: unresolved tensors " << table->unresolved_tensors.size()
          << ", with refined shapes " << second.unresolved_tensors.size() << " ("
          << status.message() << ")";
  if (VLOG_IS_ON(3)) {
    // Where the unknown sizes start: unresolved tensors whose inputs are all known.
    for (int t : second.unresolved_tensors) {
      const NodeInfo& node = second.nodes[second.tensors[t].node];
      bool inputs_known = true;
      for (int u : node.inputs) inputs_known = inputs_known && second.tensors[u].size_known;
      if (inputs_known) VLOG(3) << "unresolved from here: " << second.TensorName(t);
    }
  }
  if (status.ok() && second.unresolved_tensors.size() < table->unresolved_tensors.size()) {
    *table = std::move(second);
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
