#include "grappler/analyze/op_costs.h"

#include <string>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "tensorflow/core/grappler/costs/op_context.h"
#include "tensorflow/core/grappler/costs/op_level_cost_estimator.h"
#include "tensorflow/core/grappler/costs/utils.h"

namespace tfmemopt {

using tensorflow::DeviceProperties;
using tensorflow::NodeDef;
using tensorflow::grappler::Costs;
using tensorflow::grappler::GraphProperties;
using tensorflow::grappler::OpContext;
using tensorflow::grappler::OpLevelCostEstimator;

void EstimateComputeSeconds(const GraphProperties& properties, TensorTable* table) {
  std::unordered_map<std::string, const NodeDef*> name_to_node;
  name_to_node.reserve(table->nodes.size());
  for (const NodeInfo& node : table->nodes) name_to_node[node.def->name()] = node.def;

  OpLevelCostEstimator estimator;
  // GetDeviceInfo asks the local machine (CPU frequency and cores) or the device
  // name's type; one lookup per distinct device string is enough.
  absl::flat_hash_map<std::string, DeviceProperties> device_info;
  const std::vector<tensorflow::OpInfo::TensorProperties> no_inputs;
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
    context.op_info = tensorflow::grappler::BuildOpInfoWithoutDevice(
        def, name_to_node,
        properties.HasInputProperties(def.name()) ? properties.GetInputProperties(def.name())
                                                  : no_inputs);
    *context.op_info.mutable_device() = it->second;
    // TF's estimator prices a Slice by its output (PredictGatherOrSlice), and logs
    // a warning per node when the op info has none: the split rewrite's cuts are
    // Slices.
    if (def.op() == "Slice" && properties.HasOutputProperties(def.name())) {
      for (const auto& output : properties.GetOutputProperties(def.name())) {
        *context.op_info.add_outputs() = output;
      }
    }
    const Costs costs = estimator.PredictCosts(context);
    node.compute_seconds = static_cast<double>(costs.execution_time.count()) * 1e-9;
  }
}

}  // namespace tfmemopt
