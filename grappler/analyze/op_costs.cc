#include "grappler/analyze/op_costs.h"

#include <string>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "tensorflow/core/grappler/costs/op_context.h"
#include "tensorflow/core/grappler/costs/op_level_cost_estimator.h"
#include "tensorflow/core/grappler/costs/utils.h"
#include "tensorflow/core/grappler/utils.h"

namespace tfmemopt {

using tensorflow::DeviceProperties;
using tensorflow::NodeDef;
using tensorflow::OpInfo;
using tensorflow::grappler::Costs;
using tensorflow::grappler::GraphProperties;
using tensorflow::grappler::NodeCosts;
using tensorflow::grappler::OpContext;
using tensorflow::grappler::OpLevelCostEstimator;

namespace {

// OpLevelCostEstimator::PredictCosts logs a WARNING with the whole OpInfo ("Error in
// PredictCost() for the op", ~1 KB) for every node its op's predictor rejects, e.g.
// a StridedSlice or GatherV2 that kept an unknown dimension (constant folding
// removes the others) and so reaches it without outputs. Whether a predictor
// accepts an op info is TF's own rule, op by op; asking PredictNodeCosts (which
// returns the status instead of logging it) applies that rule without restating it.
class QuietEstimator : public OpLevelCostEstimator {
 public:
  // The op info's predictor accepts it as it is.
  bool Accepts(const OpContext& context) const {
    NodeCosts node_costs;
    return PredictNodeCosts(context, &node_costs).ok();
  }
};

}  // namespace

void EstimateComputeSeconds(const GraphProperties& properties, TensorTable* table) {
  std::unordered_map<std::string, const NodeDef*> name_to_node;
  name_to_node.reserve(table->nodes.size());
  for (const NodeInfo& node : table->nodes) name_to_node[node.def->name()] = node.def;

  QuietEstimator estimator;
  // GetDeviceInfo asks the local machine (CPU frequency and cores) or the device
  // name's type; one lookup per distinct device string is enough.
  absl::flat_hash_map<std::string, DeviceProperties> device_info;
  const std::vector<OpInfo::TensorProperties> no_inputs;
  for (NodeInfo& node : table->nodes) {
    const NodeDef& def = *node.def;
    const std::string device = def.device().empty() ? "/device:CPU:0" : def.device();
    auto it = device_info.find(device);
    if (it == device_info.end()) {
      it = device_info.emplace(device, tensorflow::grappler::GetDeviceInfo(device)).first;
    }
    OpContext context;
    context.name = def.name();
    context.device_name = device;
    const auto& inputs = properties.HasInputProperties(def.name())
                             ? properties.GetInputProperties(def.name())
                             : no_inputs;
    if (static_cast<int>(inputs.size()) == tensorflow::grappler::NumNonControlInputs(def)) {
      context.op_info = tensorflow::grappler::BuildOpInfoWithoutDevice(def, name_to_node, inputs);
    } else {
      // GraphProperties has no (or not all) input properties for some nodes, e.g.
      // the gradient of a tf.while_loop that reads a variable. BuildOpInfoWithoutDevice
      // then logs an ERROR with three protos ("OpInfo's inputs doesn't match the
      // graph!", utils.cc) for every input it cannot match. Without it, the op info
      // is the same minus the values of constant inputs, which the estimator
      // prices as unknown shapes, as it did before.
      context.op_info.set_op(def.op());
      *context.op_info.mutable_attr() = def.attr();
      for (const auto& input : inputs) *context.op_info.add_inputs() = input;
    }
    *context.op_info.mutable_device() = it->second;
    // Some predictors price an op by its outputs (PredictGatherOrSlice for Slice,
    // StridedSlice, GatherV2...), which the op info above lacks, and reject it
    // without them; give those the outputs. The other ops keep the figure they
    // get from their inputs (their plans were tuned on it).
    bool accepted = estimator.Accepts(context);
    if (!accepted && properties.HasOutputProperties(def.name())) {
      for (const auto& output : properties.GetOutputProperties(def.name())) {
        *context.op_info.add_outputs() = output;
      }
      accepted = estimator.Accepts(context);
    }
    if (!accepted) {
      // TF's PredictCosts would log a warning and return zero costs: the same figure
      // without the log.
      node.compute_seconds = 0;
      continue;
    }
    const Costs costs = estimator.PredictCosts(context);
    node.compute_seconds = static_cast<double>(costs.execution_time.count()) * 1e-9;
  }
}

}  // namespace tfmemopt
