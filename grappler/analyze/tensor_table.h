// Analyze: one row per tensor of the item's graph, with its byte size, producer,
// consumers, device, role and whether its producer is stateful.
//
// Sizes come from Grappler's GraphProperties (static inference, assuming valid
// feeds). Unknown dimensions are resolved as follows:
//  * shapes of fed tensors (item.feed) are taken as given by GraphProperties;
//  * the symbolic dimension at position 0 of every graph input (Placeholder, _Arg,
//    feed) and of every tf.data iterator output (IteratorGetNext, as in Keras's
//    fit) is the batch dimension; with assume_batch_size > 0 every dimension that
//    GraphProperties proves equal to it is replaced by that value;
//  * any dimension still unknown counts as 1, and the tensor is listed as unresolved
//    so the report can say the prediction is a lower bound.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_TENSOR_TABLE_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_TENSOR_TABLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grappler/analyze/loops.h"
#include "grappler/memory_optimizer_options.h"
#include "tensorflow/core/grappler/grappler_item.h"

namespace tfmemopt {

// What a tensor is for in a training step; the timeline is stacked by it.
enum class TensorRole {
  kPersistent,  // variables, optimizer slots and constants: alive for the whole step
  kActivation,  // produced by the forward pass
  kGradient,    // produced by the backward pass or the optimizer update
};
const char* TensorRoleName(TensorRole role);

struct TensorInfo {
  int node = -1;  // producer, index into TensorTable::nodes
  int port = 0;
  int64_t bytes = 0;
  tensorflow::DataType dtype = tensorflow::DT_INVALID;  // DT_INVALID: not inferred
  bool size_known = true;  // every dimension resolved
  TensorRole role = TensorRole::kActivation;
  // Index into TensorTable::buffers. Outputs of forwarding ops (Identity, Reshape,
  // ...) share the buffer of their input instead of allocating one.
  int buffer = -1;
  std::vector<int> consumers;  // node indices, one entry per data input edge
  // TF's runtime constant folding after Grappler (tensor_table.cc,
  // MarkRuntimeFoldedConstants): kConstant tensors become a Const that the
  // kernel holds (persistent); kIntermediate ones are only computed while folding
  // and never exist when the step runs.
  enum class Folding { kNone, kConstant, kIntermediate };
  Folding folding = Folding::kNone;
};

struct NodeInfo {
  const tensorflow::NodeDef* def = nullptr;
  std::string device;  // short form, e.g. "CPU:0"; "" when unplaced
  bool stateful = false;
  bool backward = false;  // in or downstream of the gradient computation
  // Scratch memory the kernel allocates and frees while it runs (not an output).
  int64_t temp_bytes = 0;
  // Predicted run time (OpLevelCostEstimator), for the planner's cost model.
  double compute_seconds = 0;
  // Inputs (positions in `inputs`) whose buffer output `reusable_output` takes
  // over, instead of allocating one, when this node is the buffer's last reader:
  // TF's element-wise kernels call forward_input_or_allocate_output, which forwards
  // an input whose reference count is one. Only inputs of that output's dtype and
  // byte size are listed; whether the buffer is free to take depends on the order,
  // so the simulator decides.
  std::vector<int> reusable_inputs;
  // The output that may take over a reusable input: 0, but 1 (the backprop) for the
  // softmax cross-entropy kernels, which forward the logits' buffer to it.
  int reusable_output = 0;
  // Resource inputs (positions in `inputs`) whose variable the kernel updates in
  // place. TF copies the variable first if a read of it is still live
  // (copy-on-write); the simulator counts that copy.
  std::vector<int> updated_variables;
  // Updates a variable: a resource one (updated_variables) or a tf.compat.v1
  // reference variable (Assign, Apply*, Scatter* on a ref input, updated in place
  // with no copy). The executor's order is emulated around these (ExecutorOrder).
  bool updates_variable = false;
  // Buffers the kernel allocates beyond its graph outputs, such as oneDNN's
  // MaxPool workspace (indices into TensorTable::buffers; see
  // BufferInfo::released_by). They are not graph tensors: nothing can swap or
  // recompute them.
  std::vector<int> extra_buffers;
  std::vector<int> inputs;   // tensor indices of data inputs
  std::vector<int> outputs;  // tensor indices
  std::vector<int> control_inputs;  // node indices
};

struct BufferInfo {
  int owner = -1;  // tensor that allocated it (for an extra buffer: its node's output 0)
  int64_t bytes = 0;  // device bytes
  bool persistent = false;
  // Fed by the caller (function arguments, feeds): allocated before the step
  // starts and still held by the caller when it ends.
  bool external = false;
  // An extra buffer of a kernel (NodeInfo::extra_buffers) is freed after this
  // node runs; -1 for every other buffer.
  int released_by = -1;
  // Separate allocations the buffer is made of, of bytes / pieces each: a
  // TensorList holds one per element.
  int64_t pieces = 1;
  std::string device;
  // Bytes held in host memory outside the device's allocator instead (a swapped-out
  // tensor); such a buffer has bytes == 0.
  int64_t host_bytes = 0;
  // Buffers that hold references into this one (a TensorList that stores elements
  // read from this list): it is not freed while one of them is live.
  std::vector<int> held_by;
  // A TensorList a loop fills: a loop body runs once in a simulation, so the list
  // is allocated whole when the node that fills it runs (not when it enters the
  // loop, empty), and freed once the node that pops it in the gradient loop
  // (drained_by) has run and the element it popped is read, whatever reads of the
  // emptied list remain. -1: not such a list.
  int allocated_by = -1;
  int drained_by = -1;
};

// Node name -> node index. Tables the planner derives from a table share its map
// (they only append nodes that nobody looks up by name), so copying a table does
// not copy the map; a write gives the writer a map of its own.
class NodeIndex {
 public:
  using Map = absl::flat_hash_map<std::string, int>;
  NodeIndex() : map_(std::make_shared<Map>()) {}
  Map::const_iterator find(absl::string_view name) const { return map_->find(name); }
  Map::const_iterator end() const { return map_->end(); }
  size_t count(absl::string_view name) const { return map_->count(name); }
  size_t size() const { return map_->size(); }
  int& operator[](const std::string& name) {
    if (map_.use_count() > 1) map_ = std::make_shared<Map>(*map_);
    return (*map_)[name];
  }

 private:
  std::shared_ptr<Map> map_;
};

struct TensorTable {
  std::vector<NodeInfo> nodes;
  std::vector<TensorInfo> tensors;
  std::vector<BufferInfo> buffers;
  NodeIndex node_index;
  std::vector<std::string> devices;  // sorted, every device a node is placed on
  std::vector<int> fetch_tensors;    // kept alive to the end of the step
  // Tensors with dimensions that stayed unknown; they count as 1 per unknown dim.
  std::vector<int> unresolved_tensors;
  int64_t batch_dims_resolved = 0;  // the inputs' batch, filled from assume_batch_size
  // Other dimensions shape inference left unknown, taken as assume_batch_size.
  int64_t batch_dims_assumed = 0;
  // The while-loops and the TensorLists they fill (analyze/loops.h).
  LoopAnalysis loops;
  // Every variable of the graph is a VarHandleOp that a graph the pass saw before
  // initialized (a v1 Session's initializer, analyze/initial_values.h): the resident
  // buffers were made in graph order, so the simulator need not replay other
  // histories (simulate's ResidentHistory). False for variables that reach the graph
  // as arguments (tf.function, Keras), whose history the graph does not tell.
  bool variables_made_by_recorded_initializer = false;

  std::string TensorName(int tensor) const;
};

// The loop (index into TensorTable::loops.loops) `node` runs in, -1 outside every
// loop (for a nested loop, the innermost). Nodes the loop analysis did not see
// (added after it) count as outside.
inline int LoopOf(const TensorTable& table, int node) {
  const std::vector<int>& loop_of = table.loops.loop_of_node;
  return node < static_cast<int>(loop_of.size()) ? loop_of[node] : -1;
}

// The input port whose buffer output `port` of `node` hands out instead of
// allocating one (Identity, Reshape, ReadVariableOp, loop plumbing...), or -1.
int ForwardedInput(const tensorflow::NodeDef& node, int port);

// Short device name ("/job:localhost/replica:0/task:0/device:CPU:0" -> "CPU:0").
std::string ShortDeviceName(const std::string& device);

// True for ops that only read their input's shape (Shape, ShapeN, Size, Rank).
bool ReadsShapeOnly(const std::string& op);

// Bytes node `n` allocates for its outputs: the buffers its outputs own (not
// forwarded from an input) that are not persistent.
int64_t AllocatedOutputBytes(const TensorTable& table, int n);

// A function's return value (_Retval, _DeviceRetval). TF takes these out of the
// function's body, so no node may read one or wait for one.
bool IsReturnValue(const tensorflow::NodeDef& def);

absl::Status BuildTensorTable(const tensorflow::grappler::GrapplerItem& item,
                              const MemoryOptimizerOptions& options,
                              TensorTable* table);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_TENSOR_TABLE_H_
