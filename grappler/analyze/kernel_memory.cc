#include "grappler/analyze/kernel_memory.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/util.h"
#include "tsl/platform/cpu_info.h"

namespace tfmemopt {
namespace {

using tensorflow::grappler::GraphProperties;

// ---------------------------------------------------------------------------
// Shapes

// The dimensions of input `port` of `node` as shape inference sees them, with
// one unknown dimension (the batch, typically) recovered from the tensor's
// byte size in the table; false if the rank is unknown or more than one
// dimension is.
bool InputDims(const GraphProperties& properties, const TensorTable& table,
               const NodeInfo& node, int port, std::vector<int64_t>* dims) {
  if (!properties.HasInputProperties(node.def->name())) return false;
  const auto& inputs = properties.GetInputProperties(node.def->name());
  if (port >= static_cast<int>(inputs.size()) || port >= static_cast<int>(node.inputs.size())) {
    return false;
  }
  const auto& props = inputs[port];
  if (props.shape().unknown_rank()) return false;
  dims->clear();
  int unknown = -1;
  int64_t known = 1;
  for (int i = 0; i < props.shape().dim_size(); ++i) {
    const int64_t d = props.shape().dim(i).size();
    if (d < 0) {
      if (unknown >= 0) return false;
      unknown = i;
    } else {
      known *= d;
    }
    dims->push_back(d);
  }
  if (unknown < 0) return true;
  const TensorInfo& tensor = table.tensors[node.inputs[port]];
  const int64_t element = tensorflow::DataTypeSize(props.dtype());
  if (!tensor.size_known || element <= 0 || known <= 0) return false;
  (*dims)[unknown] = tensor.bytes / element / known;
  return true;
}

int64_t Product(const std::vector<int64_t>& dims) {
  int64_t out = 1;
  for (int64_t d : dims) out *= d;
  return out;
}

// ---------------------------------------------------------------------------
// Einsum (tensorflow/core/kernels/linalg/einsum_op_impl.h; oneDNN's _MklEinsum,
// mkl_einsum_op.cc, follows the same steps with oneDNN's batch matmul).
//
// EinsumOp::Compute reduces each operand (EinsumHelper::ReduceOperand): it
// transposes the operand into [batch, free, contract, reduce] order unless that
// is the identity or a swap of free and contract (BatchMatMul's adjoint flags do
// that), takes the diagonal of repeated labels and sums the reduce labels, each
// step into a new temporary. The contraction's result is a temporary of the
// batch and free labels ([broadcast, batch (label order), free of operand 0,
// free of operand 1]); unless that is already the output's order, it is
// transposed into another one, which becomes the output. Every temporary lives
// until Compute returns.

enum EinsumType { kBroadcasting = 0, kBatch = 1, kFree = 2, kContract = 3, kReduce = 4 };

// Labels of one subscript as EinsumHelper::MapToLabels numbers them (first
// appearance over the inputs, then the output), with an ellipsis expanded to
// `num_bcast` broadcasting labels numbered from `first_bcast`.
std::vector<int> MapLabels(const std::string& subscript, std::map<char, int>* mapping,
                           int num_bcast, int first_bcast, bool* has_ellipsis) {
  std::vector<int> labels;
  *has_ellipsis = false;
  for (size_t i = 0; i < subscript.size(); ++i) {
    const char c = subscript[i];
    if (c == '.') {
      *has_ellipsis = true;
      for (int k = 0; k < num_bcast; ++k) labels.push_back(first_bcast + k);
      i += 2;
      continue;
    }
    auto it = mapping->find(c);
    if (it == mapping->end()) it = mapping->emplace(c, static_cast<int>(mapping->size())).first;
    labels.push_back(it->second);
  }
  return labels;
}

// Einsum's scratch beyond its output, or 0 when the equation or a shape is not
// understood.
int64_t EinsumScratch(const std::string& raw_equation,
                      const std::vector<std::vector<int64_t>>& dims, int64_t element) {
  std::string equation;
  for (char c : raw_equation) {
    if (c != ' ') equation.push_back(c);
  }
  const std::vector<std::string> sides = absl::StrSplit(equation, "->");
  if (sides.size() != 2) return 0;
  const std::vector<std::string> inputs = absl::StrSplit(sides[0], ',');
  if (inputs.size() != dims.size() || inputs.empty() || inputs.size() > 2) return 0;
  const int num_inputs = static_cast<int>(inputs.size());

  // Named labels first (MapToLabels over the inputs, then the output), then
  // the broadcasting ones (ProcessDimensions: one per dimension an ellipsis
  // stands for, numbered after the named labels).
  std::map<char, int> mapping;
  bool ellipsis = false;
  for (const std::string& s : inputs) MapLabels(s, &mapping, 0, 0, &ellipsis);
  MapLabels(sides[1], &mapping, 0, 0, &ellipsis);
  const int num_named = static_cast<int>(mapping.size());
  std::vector<std::vector<int>> labels(num_inputs);
  int max_bcast = 0;
  for (int i = 0; i < num_inputs; ++i) {
    int named = 0;
    for (char c : inputs[i]) named += c != '.';
    const int num_bcast = static_cast<int>(dims[i].size()) - named;
    if (num_bcast < 0) return 0;
    labels[i] = MapLabels(inputs[i], &mapping, num_bcast, num_named, &ellipsis);
    if (!ellipsis && num_bcast != 0) return 0;
    if (ellipsis) max_bcast = std::max(max_bcast, num_bcast);
    if (labels[i].size() != dims[i].size()) return 0;
  }
  std::vector<int> output = MapLabels(sides[1], &mapping, max_bcast, num_named, &ellipsis);
  const int num_labels = num_named + max_bcast;
  if (static_cast<int>(mapping.size()) != num_named) return 0;  // a label only in the output

  std::vector<std::vector<int>> input_counts(num_inputs, std::vector<int>(num_labels, 0));
  std::vector<int> output_counts(num_labels, 0);
  std::vector<int64_t> label_dim(num_labels, 1);
  for (int i = 0; i < num_inputs; ++i) {
    for (size_t k = 0; k < labels[i].size(); ++k) {
      ++input_counts[i][labels[i][k]];
      label_dim[labels[i][k]] = dims[i][k];
    }
  }
  for (int label : output) ++output_counts[label];
  std::vector<int> types(num_labels, kBroadcasting);
  for (int label = 0; label < num_named; ++label) {
    const bool removed = output_counts[label] == 0;
    const bool unique = num_inputs == 1 || input_counts[0][label] == 0 ||
                        input_counts[1][label] == 0;
    types[label] = !removed ? (unique ? kFree : kBatch) : (unique ? kReduce : kContract);
  }

  int64_t held = 0;  // operands' reduced copies, live until Compute returns
  int64_t peak = 0;
  int64_t last_copy = 0;  // the last operand's reduced copy (0: none)
  std::vector<std::vector<int>> free_labels(num_inputs);
  for (int i = 0; i < num_inputs; ++i) {
    const std::vector<int>& l = labels[i];
    const int64_t bytes = Product(dims[i]) * element;
    // ShouldSwapFreeAndContract: already [batch, contract, free, reduce].
    const int remap[5] = {0, 1, 3, 2, 4};
    bool swap = true;
    for (size_t k = 0; k + 1 < l.size(); ++k) {
      const int a = remap[types[l[k]]], b = remap[types[l[k + 1]]];
      if (a > b || (a == b && l[k] > l[k + 1])) swap = false;
    }
    std::vector<int> permutation(l.size());
    std::iota(permutation.begin(), permutation.end(), 0);
    if (!swap) {
      std::sort(permutation.begin(), permutation.end(), [&](int a, int b) {
        return std::tie(types[l[a]], l[a]) < std::tie(types[l[b]], l[b]);
      });
    }
    bool identity = true;
    for (size_t k = 0; k < permutation.size(); ++k) identity &= permutation[k] == static_cast<int>(k);
    int64_t transient = 0;  // this operand's temporaries
    int64_t current = 0;    // the one it ends with (0: the input itself)
    if (!identity && l.size() >= 2 && bytes > 0) {
      transient += bytes;
      current = bytes;
    }
    // The generalized diagonal of repeated labels (StrideOrInflate).
    std::vector<int> unique_labels;
    for (int k : permutation) unique_labels.push_back(l[k]);
    unique_labels.erase(std::unique(unique_labels.begin(), unique_labels.end()),
                        unique_labels.end());
    const bool repeated = unique_labels.size() != l.size();
    int64_t deduped_elements = 1;
    for (int label : unique_labels) deduped_elements *= label_dim[label];
    if (repeated) {
      transient += deduped_elements * element;
      current = deduped_elements * element;
    }
    // The sum over reduce labels.
    int64_t reduce = 1;
    for (int label : unique_labels) {
      if (types[label] == kReduce) reduce *= label_dim[label];
      if (types[label] == kFree) free_labels[i].push_back(label);
    }
    if (reduce != 1) {
      transient += deduped_elements / reduce * element;
      current = deduped_elements / reduce * element;
    }
    peak = std::max(peak, held + transient);
    held += current;
    last_copy = current;
  }

  // The contraction's result: [broadcast, batch, free of 0, free of 1].
  std::vector<int> result;
  for (int label = 0; label < num_labels; ++label) {
    if (types[label] == kBroadcasting) result.push_back(label);
  }
  for (int label = 0; label < num_labels; ++label) {
    if (types[label] == kBatch) result.push_back(label);
  }
  for (int i = 0; i < num_inputs; ++i) {
    result.insert(result.end(), free_labels[i].begin(), free_labels[i].end());
  }
  int64_t result_elements = 1;
  for (int label : result) result_elements *= label_dim[label];
  // Inflation of repeated output labels.
  bool inflate = false;
  for (int c : output_counts) inflate |= c > 1;
  int64_t inflated_bytes = 0;
  std::vector<int> result_labels = result;
  if (inflate) {
    result_labels.clear();
    int64_t elements = 1;
    for (int label : result) {
      for (int k = 0; k < output_counts[label]; ++k) {
        result_labels.push_back(label);
        elements *= label_dim[label];
      }
    }
    inflated_bytes = elements * element;
  }
  // The transpose into the output's order.
  std::vector<int> position(num_labels, -1);
  for (size_t k = 0; k < result_labels.size(); ++k) {
    if (position[result_labels[k]] < 0) position[result_labels[k]] = static_cast<int>(k);
  }
  bool transpose = false;
  for (size_t k = 0; k < output.size(); ++k) {
    if (position[output[k]] != static_cast<int>(k)) transpose = true;
    ++position[output[k]];
  }
  transpose &= output.size() >= 2;
  // Temporaries after the reduction: the contraction's result (with one operand,
  // its reduced copy is the result), its inflation, its transpose. The last one
  // is the output, which the simulator counts as the node's output; the kernel
  // holds at most max(peak, everything at the end), the output included.
  std::vector<int64_t> stages;
  if (num_inputs == 2) stages.push_back(result_elements * element);
  if (inflate) stages.push_back(inflated_bytes);
  if (transpose) stages.push_back(inflate ? inflated_bytes : result_elements * element);
  int64_t at_end = held;
  for (int64_t bytes : stages) at_end += bytes;
  int64_t output_bytes = stages.empty() ? last_copy : stages.back();
  return std::max<int64_t>(std::max(peak, at_end) - output_bytes, 0);
}

// ---------------------------------------------------------------------------
// A grouped convolution's filter gradient compiled by XLA on the CPU.
//
// Keras 3 runs a grouped Conv2D (filter in-depth < input depth; ConvNeXt's 7x7
// depthwise one has groups = channels) through tf.function(jit_compile=True)
// (keras/src/backend/tensorflow/nn.py, conv: TF's CPU Conv2DBackpropFilter, the
// Eigen one of conv_grad_filter_ops.cc, has no grouped path), and TF makes the
// gradient of that call a backward function XLA compiles too. tf2xla lowers
// Conv2DBackpropFilter of a grouped convolution to a convolution with
// batch_group_count = groups (MakeXlaBackpropFilterConvOp), which XLA's CPU
// backend cannot run: ConvolutionGroupConverter (HandleBatchGroupCount) turns it
// into an ungrouped convolution giving the dense gradient [in_depth, kh, kw,
// out_depth] over a transposed copy of out_backprop, a select of its block
// diagonal (GetExpandedFilterMask) into a second dense buffer, and a
// reduce-window down to the filter's shape. XLA's buffer assignment puts the
// temporaries in one allocation, the transposed out_backprop and the masked
// copy sharing a slot (neither lives while the other does): the dense gradient
// plus the larger of the two. Read from the optimized HLO and its buffer
// assignment (XLA_FLAGS=--xla_dump_to) of the backward function, and matched
// byte for byte by the anonymous allocation in TF's allocator trace, at four
// shapes. The transposed input, and the forward convolution and
// Conv2DBackpropInput (XLA runs feature_group_count natively), add nothing.

// Where `ref` (an input of a node in `function`'s body) comes from: the index of
// the call's input it passes on unchanged through Identity nodes, or -1.
int CallInputOf(const tensorflow::FunctionDef& function, const std::string& ref) {
  std::string name = ref;
  for (int hops = 0; hops < 16; ++hops) {
    const std::vector<std::string> parts = absl::StrSplit(name, ':');
    if (parts.size() == 1) {
      const auto& args = function.signature().input_arg();
      for (int i = 0; i < args.size(); ++i) {
        if (args[i].name() == parts[0]) return i;
      }
      return -1;
    }
    const tensorflow::NodeDef* node = nullptr;
    for (const auto& n : function.node_def()) {
      if (n.name() == parts[0]) node = &n;
    }
    if (node == nullptr || node->input_size() == 0) return -1;
    if (node->op() == "Identity") {
      name = node->input(0);
    } else {
      return -1;
    }
  }
  return -1;
}

// The dimensions of the tensor `ref` names in `function`'s body as the call's
// input, or of the shape `ref` holds when it is a Shape / ShapeN of one.
bool RefDims(const GraphProperties& properties, const TensorTable& table, const NodeInfo& call,
             const tensorflow::FunctionDef& function, const std::string& ref, bool shape_of,
             std::vector<int64_t>* dims) {
  if (!shape_of) {
    const int port = CallInputOf(function, ref);
    return port >= 0 && InputDims(properties, table, call, port, dims);
  }
  const std::vector<std::string> parts = absl::StrSplit(ref, ':');
  if (parts.size() != 3) return false;
  int index = 0;
  if (!absl::SimpleAtoi(parts[2], &index)) return false;
  for (const auto& node : function.node_def()) {
    if (node.name() != parts[0]) continue;
    if (node.op() == "ShapeN" && index < node.input_size()) {
      return RefDims(properties, table, call, function, node.input(index), false, dims);
    }
    if (node.op() == "Shape" && index == 0 && node.input_size() > 0) {
      return RefDims(properties, table, call, function, node.input(0), false, dims);
    }
    if (node.op() == "Const" && node.attr().count("value")) {
      tensorflow::Tensor value;
      if (!value.FromProto(node.attr().at("value").tensor()) || value.dims() != 1) return false;
      dims->clear();
      for (int64_t i = 0; i < value.NumElements(); ++i) {
        dims->push_back(value.dtype() == tensorflow::DT_INT64 ? value.vec<int64_t>()(i)
                                                             : value.vec<int32_t>()(i));
      }
      return true;
    }
  }
  return false;
}

// The temp bytes XLA's executable of `call` holds for the grouped filter gradients
// in its function, or 0.
int64_t XlaGroupedFilterGradScratch(const GraphProperties& properties, const TensorTable& table,
                                    const NodeInfo& call,
                                    const tensorflow::FunctionDef& function) {
  int64_t scratch = 0;
  for (const auto& node : function.node_def()) {
    if (node.op() != "Conv2DBackpropFilter" || node.input_size() < 3) continue;
    std::vector<int64_t> input, filter, out_backprop;
    if (!RefDims(properties, table, call, function, node.input(0), false, &input) ||
        !RefDims(properties, table, call, function, node.input(1), true, &filter) ||
        input.size() != 4 || filter.size() != 4) {
      continue;
    }
    const bool nchw = node.attr().count("data_format") && node.attr().at("data_format").s() == "NCHW";
    const int64_t in_depth = input[nchw ? 1 : 3];
    if (filter[2] <= 0 || filter[2] == in_depth) continue;  // not grouped: XLA runs it as is
    const tensorflow::DataType dtype =
        node.attr().count("T") ? node.attr().at("T").type() : tensorflow::DT_FLOAT;
    const int64_t element = tensorflow::DataTypeSize(dtype);
    const int64_t dense = filter[0] * filter[1] * in_depth * filter[3] * element;
    int64_t transposed = 0;  // out_backprop's copy; unknown: the dense buffer bounds it
    if (RefDims(properties, table, call, function, node.input(2), false, &out_backprop)) {
      transposed = Product(out_backprop) * element;
    }
    scratch = std::max(scratch, dense + std::max(dense, transposed));
  }
  return scratch;
}

// ---------------------------------------------------------------------------
// Conv2DBackpropFilter and Conv2DBackpropInput on the CPU without oneDNN: with
// TF_ENABLE_ONEDNN_OPTS=0, or for a type oneDNN does not take on this CPU (half
// without AVX-512 FP16: its layout pass logs "Falling back to the default
// Eigen-based implementation"). TF's own kernels (Conv2DCustomBackpropFilterOp in
// conv_grad_filter_ops.cc, Conv2DCustomBackpropInputOp in conv_grad_input_ops.h)
// im2col a shard of images at a time into one temporary, `col_buffer`, of
// shard x output_image_size x filter_total_size elements. The shard is sized to
// fill a 30 MiB "L3 cache" with one image's matmul working set (work_unit_size):
//   filter: shard = ceil((30 MiB / element) / work), work = ois * fts + ois * F + fts * F;
//   input:  the same, except that one image at a time (shard 1, a parallel
//           contraction) when the batch is 1 or the work per intra-op thread is at
//           least a 256 KiB "L2 cache".
// (ois: output rows x cols; fts: filter rows x cols x input depth; F: output depth.)
// The shard is not capped by the batch. Measured with RunMetadata's per-kernel
// temp_memory_size (FULL_TRACE) at six shapes, float and half, byte for byte:
// e.g. [128, 32, 32, 32] -> 64 filters 3x3 holds 23.6 MiB in the filter gradient
// and 1.1 MiB in the input gradient, where the oneDNN kernels hold none.

constexpr int64_t kConvL3CacheBytes = int64_t{30} << 20;
constexpr int64_t kConvL2CacheBytes = int64_t{256} << 10;

// Whether TF runs the Conv2D backprop `node` with its own kernels (see above).
bool UsesEigenConvBackprop(const NodeInfo& node, tensorflow::DataType dtype) {
  // An unplaced node (a graph analyzed without devices) runs on the CPU here.
  if (!node.device.empty() && !absl::StartsWith(node.device, "CPU")) return false;
  if (node.def->attr().count("data_format") && node.def->attr().at("data_format").s() != "NHWC") {
    return false;
  }
  static const bool onednn = tensorflow::IsMKLEnabled();
  return !onednn || !tensorflow::IsDataTypeSupportedByOneDNNOnThisCPU(dtype);
}

// The col_buffer of a Conv2D backprop on TF's own CPU kernels, or 0.
int64_t ConvBackpropScratch(const GraphProperties& properties, const TensorTable& table,
                            const NodeInfo& node) {
  const std::string& op = node.def->op();
  const bool filter_grad = op == "Conv2DBackpropFilter";
  if ((!filter_grad && op != "Conv2DBackpropInput") || node.inputs.size() < 3 ||
      !node.def->attr().count("T")) {
    return 0;
  }
  const tensorflow::DataType dtype = node.def->attr().at("T").type();
  const int64_t element = tensorflow::DataTypeSize(dtype);
  if (element <= 0 || !UsesEigenConvBackprop(node, dtype)) return 0;
  // out_backprop [N, out_rows, out_cols, F]; the filter [rows, cols, in_depth, F] is
  // the filter gradient's output, or the input gradient's input 1.
  std::vector<int64_t> out_backprop, filter;
  if (!InputDims(properties, table, node, 2, &out_backprop) || out_backprop.size() != 4) return 0;
  if (filter_grad) {
    if (!properties.HasOutputProperties(node.def->name())) return 0;
    const auto& outputs = properties.GetOutputProperties(node.def->name());
    if (outputs.empty() || outputs[0].shape().unknown_rank()) return 0;
    for (const auto& dim : outputs[0].shape().dim()) filter.push_back(dim.size());
  } else if (!InputDims(properties, table, node, 1, &filter)) {
    return 0;
  }
  if (filter.size() != 4) return 0;
  for (int64_t d : filter) {
    if (d <= 0) return 0;
  }
  const int64_t batch = out_backprop[0];
  const int64_t ois = out_backprop[1] * out_backprop[2];
  const int64_t fts = filter[0] * filter[1] * filter[2];
  const int64_t depth = filter[3];
  if (ois <= 0 || batch <= 0) return 0;
  const int64_t work = ois * fts + ois * depth + fts * depth;
  const int64_t target = kConvL3CacheBytes / element;
  int64_t shard = (target + work - 1) / work;
  if (!filter_grad) {
    const int64_t threads = std::max(1, tsl::port::MaxParallelism());
    if (batch == 1 || work / threads >= kConvL2CacheBytes / element) shard = 1;
  }
  return shard * ois * fts * element;
}

}  // namespace

// ---------------------------------------------------------------------------
// MaxPool and MaxPoolGrad, measured with benchmarks/trace_step_memory.py (the
// BFC allocator's own trace of a training step):
//  * with oneDNN (TF's default on x86 CPUs), its layout pass gives a float
//    MaxPool whose output a MaxPoolGrad reads a second output, a workspace of one
//    byte per output element, which the MaxPoolGrad reads instead of recomputing
//    the pooling: 4.5 MiB next to the CNN's 18 MiB pooled output, live until
//    MaxPoolGrad, and no scratch there;
//  * without it, Eigen's MaxPoolGrad allocates a copy of the pooled output and
//    its int64 argmax as temporaries: 3x its gradient input.
bool UsesOneDnnWorkspace(const TensorTable& table, const NodeInfo& grad) {
  static const bool onednn = tensorflow::IsMKLEnabled();
  if (!onednn || grad.def->op() != "MaxPoolGrad" || grad.inputs.size() < 3 ||
      !absl::StartsWith(grad.device, "CPU")) {
    return false;
  }
  const TensorInfo& pooled = table.tensors[grad.inputs[1]];
  return table.nodes[pooled.node].def->op() == "MaxPool" && pooled.port == 0 &&
         (pooled.dtype == tensorflow::DT_FLOAT || pooled.dtype == tensorflow::DT_BFLOAT16);
}

int64_t MaxPoolGradScratchBytes(const TensorTable& table, const NodeInfo& grad) {
  return grad.inputs.size() >= 3 ? 3 * table.tensors[grad.inputs[2]].bytes : 0;
}

void EstimateKernelScratch(const GraphProperties& properties,
                           const tensorflow::FunctionDefLibrary& library, TensorTable* table) {
  for (NodeInfo& node : table->nodes) {
    const std::string& op = node.def->op();
    if ((op == "PartitionedCall" || op == "StatefulPartitionedCall") &&
        absl::StartsWith(node.device, "CPU") && node.def->attr().count("f") &&
        node.def->attr().count("_XlaMustCompile") &&
        node.def->attr().at("_XlaMustCompile").b()) {
      for (const auto& function : library.function()) {
        if (function.signature().name() == node.def->attr().at("f").func().name()) {
          node.temp_bytes = XlaGroupedFilterGradScratch(properties, *table, node, function);
          break;
        }
      }
    } else if ((op == "MaxPoolGrad" || op == "MaxPoolGradV2") && node.inputs.size() >= 3 &&
        !UsesOneDnnWorkspace(*table, node)) {
      node.temp_bytes = MaxPoolGradScratchBytes(*table, node);
    } else if (op == "Conv2DBackpropFilter" || op == "Conv2DBackpropInput") {
      node.temp_bytes = ConvBackpropScratch(properties, *table, node);
    } else if (op == "Einsum" && node.def->attr().count("equation") && !node.outputs.empty()) {
      std::vector<std::vector<int64_t>> dims(node.inputs.size());
      bool known = true;
      for (size_t i = 0; i < node.inputs.size() && known; ++i) {
        known = InputDims(properties, *table, node, static_cast<int>(i), &dims[i]);
      }
      const TensorInfo& out = table->tensors[node.outputs[0]];
      const int64_t element = tensorflow::DataTypeSize(out.dtype);
      if (known && element > 0) {
        node.temp_bytes = EinsumScratch(node.def->attr().at("equation").s(), dims, element);
      }
    }
  }
}

void AddKernelBuffers(TensorTable* table) {
  for (size_t n = 0; n < table->nodes.size(); ++n) {
    const NodeInfo& grad = table->nodes[n];
    if (!UsesOneDnnWorkspace(*table, grad)) continue;
    const TensorInfo& pooled = table->tensors[grad.inputs[1]];
    NodeInfo& pool = table->nodes[pooled.node];
    BufferInfo buffer;
    buffer.owner = pool.outputs[0];
    buffer.bytes = pooled.bytes / tensorflow::DataTypeSize(pooled.dtype);
    buffer.device = pool.device;
    buffer.released_by = static_cast<int>(n);
    pool.extra_buffers.push_back(static_cast<int>(table->buffers.size()));
    table->buffers.push_back(buffer);
  }
}

}  // namespace tfmemopt
