// TfMemOpt: the tfmemopt Grappler pass.
//
// Registered as "TfMemOpt" in CustomGraphOptimizerRegistry, it runs after TF's
// built-in optimizers whenever a graph function or Session graph is built. The
// pipeline is analyze -> simulate -> plan -> rewrite -> verify -> report; each stage
// lives in its own directory under grappler/.
//
// Guarantees:
//  * Nothing lost: if any stage fails, the original graph is returned and one
//    WARNING line names the stage and the reason. TF never fails because of us.
//  * Last: the meta-optimizer runs custom optimizers in each of its iterations.
//    The pass rewrites only in the last one, so that no TF pass runs after it and
//    changes what it added (constant folding, the remapper's fusions and the
//    arithmetic optimizer's reorderings would change a clone's numerics). Earlier
//    iterations return the graph as it is.
//  * Idempotent: a graph that already holds our nodes is not rewritten again.
#ifndef TFMEMOPT_GRAPPLER_TFMEMOPT_OPTIMIZER_H_
#define TFMEMOPT_GRAPPLER_TFMEMOPT_OPTIMIZER_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "grappler/memory_optimizer_options.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer.h"
#include "tensorflow/core/protobuf/meta_graph.pb.h"

namespace tfmemopt {

inline constexpr char kTfMemOptName[] = "TfMemOpt";

class TfMemOptOptimizer : public tensorflow::grappler::CustomGraphOptimizer {
 public:
  TfMemOptOptimizer() = default;
  ~TfMemOptOptimizer() override = default;

  std::string name() const override { return kTfMemOptName; }
  bool UsesFunctionLibrary() const override { return false; }

  absl::Status Init(
      const tensorflow::RewriterConfig_CustomGraphOptimizer* config) override;

  absl::Status Optimize(tensorflow::grappler::Cluster* cluster,
                        const tensorflow::grappler::GrapplerItem& item,
                        tensorflow::GraphDef* optimized_graph) override;

  const MemoryOptimizerOptions& options() const { return options_; }

 private:
  MemoryOptimizerOptions options_;
  // Per graph id: one optimizer instance serves both meta-optimizer iterations of
  // a graph. The second replaces the first's report, and logs only if its summary
  // line differs, so each graph gets one line.
  struct Published {
    int64_t token = 0;
    std::string summary;
    bool rewrote = false;  // this instance rewrote the graph (its nodes are ours)
    int calls = 0;         // meta-optimizer iterations seen
  };
  // Meta-optimizer iterations (RewriterConfig.meta_optimizer_iterations).
  int iterations_ = 2;
  absl::flat_hash_map<std::string, Published> published_;
};

// Runs the pass once on `metagraph` (its "train_op" collection names the fetches),
// outside TF's meta-optimizer: no built-in pass runs first, no cluster is known.
// For benchmarks and tests that need the planner on exactly one given graph.
// `graph` receives the output, `report_json` the report, `table_json` (if not
// null) the tensor table the pass analyzed (see report/table_export.h).
absl::Status RunTfMemOptOnMetaGraph(const tensorflow::MetaGraphDef& metagraph,
                                    const tensorflow::RewriterConfig_CustomGraphOptimizer& entry,
                                    tensorflow::GraphDef* graph, std::string* report_json,
                                    std::string* table_json);

// Registers TfMemOpt with Grappler unless a pass of that name is registered
// already. Returns false in that case: registering twice aborts the process.
bool RegisterTfMemOptOnce();

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_TFMEMOPT_OPTIMIZER_H_
