// Verify: an output graph is only returned if it is still a valid graph for the
// item. Any failure here makes the pass fall back to the original graph.
#ifndef TFMEMOPT_GRAPPLER_VERIFY_GRAPH_VERIFIER_H_
#define TFMEMOPT_GRAPPLER_VERIFY_GRAPH_VERIFIER_H_

#include "absl/status/status.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/grappler/grappler_item.h"

namespace tfmemopt {

// Checks that node names are unique, every input names an existing node and none a
// function's return value (_Retval, _DeviceRetval), the graph
// is acyclic (NextIteration back edges aside), and every fetch and every node that
// must be preserved (item.NodesToPreserve()) is still present.
absl::Status VerifyOptimizedGraph(const tensorflow::grappler::GrapplerItem& item,
                                  const tensorflow::GraphDef& optimized);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_VERIFY_GRAPH_VERIFIER_H_
