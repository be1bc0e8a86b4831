// Analyze: the nodes a step really runs.
//
// A Session's graph can hold nodes that no fetch needs (a second tf.gradients call
// whose result is never fetched, summaries, an unused head); TF's executor prunes
// them before it runs the graph (subgraph::RewriteGraphForExecution), so they never
// allocate anything. The pass plans and simulates only what runs, and hands the
// rest back untouched.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_EXECUTED_NODES_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_EXECUTED_NODES_H_

#include <vector>

#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/grappler/grappler_item.h"

namespace tfmemopt {

// Splits `item` into the item the step runs (`executed`: the transitive fan-in,
// over data and control edges, of the fetches, the fed nodes and the nodes Grappler must keep,
// stopping at fed tensors) and the nodes it never runs (`never_run`, in graph
// order). Returns false, leaving both empty, when every node runs or when the item
// names no fetch (nothing to prune against).
bool SplitNeverRunNodes(const tensorflow::grappler::GrapplerItem& item,
                        tensorflow::grappler::GrapplerItem* executed,
                        std::vector<tensorflow::NodeDef>* never_run);

// Appends the `never_run` nodes to `graph` (the pass's output for the executed
// item), except those that read, directly or through other never-run nodes, a node
// `graph` no longer has: a split removes the ops it slices, and a node that never
// runs gets no join of its own. Such a node would make the graph invalid; leaving
// it out changes nothing the step runs. Returns how many were left out.
int AppendNeverRunNodes(std::vector<tensorflow::NodeDef> never_run,
                        tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_EXECUTED_NODES_H_
