#include "grappler/verify/graph_verifier.h"

#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/grappler/op_types.h"
#include "tensorflow/core/grappler/utils.h"
#include "tensorflow/core/grappler/utils/topological_sort.h"

namespace tfmemopt {

absl::Status VerifyOptimizedGraph(const tensorflow::grappler::GrapplerItem& item,
                                  const tensorflow::GraphDef& optimized) {
  absl::flat_hash_set<std::string> names;
  for (const auto& node : optimized.node()) {
    if (!names.insert(node.name()).second) {
      return absl::InternalError(absl::StrCat("duplicate node name ", node.name()));
    }
  }
  // A function's return values leave its body when TF makes the function, so no
  // node may read or wait for one (TF: "The source of control edge ... is not in the
  // body").
  absl::flat_hash_set<std::string> return_values;
  for (const auto& node : optimized.node()) {
    if (IsReturnValue(node)) {
      return_values.insert(node.name());
    }
  }
  for (const auto& node : optimized.node()) {
    for (const std::string& input : node.input()) {
      const std::string source = tensorflow::grappler::NodeName(input);
      if (!names.contains(source)) {
        return absl::InternalError(
            absl::StrCat("node ", node.name(), " reads missing input ", input));
      }
      if (return_values.contains(source)) {
        return absl::InternalError(absl::StrCat("node ", node.name(),
                                                " reads or waits for the return value ",
                                                source));
      }
    }
  }
  for (const std::string& keep : item.NodesToPreserve()) {
    if (!names.contains(keep)) {
      return absl::InternalError(absl::StrCat("preserved node ", keep, " was removed"));
    }
  }
  std::vector<const tensorflow::NodeDef*> order;
  absl::Status acyclic = tensorflow::grappler::ComputeTopologicalOrder(optimized, &order);
  if (!acyclic.ok()) {
    return absl::InternalError(absl::StrCat("graph has a cycle: ", acyclic.message()));
  }
  return absl::OkStatus();
}

}  // namespace tfmemopt
