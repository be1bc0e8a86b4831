// Rewrite: keep the node merges of TF's oneDNN layout pass.
//
// After Grappler, TF's oneDNN layout pass (mkl_layout_pass.cc, on by default in the
// x86 CPU wheel) merges pairs of nodes into one kernel: Conv2D + BiasAdd,
// Conv2DBackpropFilter + BiasAddGrad (the bias gradient is then reduced inside
// oneDNN's weight-gradient primitive), Pad + Conv2D and Pad + _FusedConv2D. It
// merges a pair only when both nodes have the same control inputs
// (CheckForNodeMerge), in the same order, and for Conv2D + BiasAdd and the Pad pairs
// only when the first node's one out-edge goes to the second. A merged kernel sums
// in another order than the two kernels it replaces, so a control edge that the
// pass adds to one node of a pair (the order guard's, the scheduling stage's) or
// an out-edge it adds to the first node changes the results' last bits.
//
// KeepOneDnnMerges restores, in the rewritten graph, the conditions of every pair
// that the original graph met: a control input added to one node of a pair is
// added to the other too (the merged node waits for both anyway), or removed from
// both where adding it would close a cycle through the merged node or push a node
// past the in-edges TF's EdgeSet keeps in insertion order; a control edge added
// from the first node of a Conv2D + BiasAdd or Pad pair starts at the second
// instead. A data edge added from the first node (a swap-out or a clone reading
// it) is left and counted: the pair then runs unmerged.
//
// A BiasAddGrad whose gradient feeds several Conv2DBackpropFilter nodes (a residual
// block's two convolutions: their bias gradients are one node after CSE) merges
// with whichever comes first in the GraphDef Grappler returns, a topological sort.
// The rewrite can reorder that sort; each other Conv2DBackpropFilter then waits for
// the original partner (a control edge), so the partner stays the same.
#ifndef TFMEMOPT_GRAPPLER_REWRITE_ONEDNN_MERGE_GUARD_H_
#define TFMEMOPT_GRAPPLER_REWRITE_ONEDNN_MERGE_GUARD_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

struct MergeGuardResult {
  int pairs = 0;              // pairs the original graph lets TF merge
  int edges_shared = 0;       // control inputs added to a pair's other node
  int edges_removed = 0;      // control inputs taken back from a pair
  int edges_moved = 0;        // control out-edges moved from a first node to the second
  int partner_edges = 0;      // rivals made to wait for a BiasAddGrad's merge partner
  int cycle_edges_moved = 0;    // BreakMergeCycles: edges moved to the pair's gradient
  int cycle_edges_removed = 0;  // BreakMergeCycles: edges taken back
  std::vector<std::string> unmerged;  // pairs left unmerged by an added data edge
};

// Edits `rewritten` (the pass's output for `original`) as described above.
absl::Status KeepOneDnnMerges(const tensorflow::GraphDef& original,
                              tensorflow::GraphDef* rewritten, MergeGuardResult* result);

// A pair the layout pass merges becomes one kernel, so a path from one of its nodes
// to the other in `rewritten` is a cycle in the graph TF runs ("N nodes in a
// cycle", after Grappler, where the pass can no longer fall back). The pass's own
// edges can make one between a Conv2DBackpropFilter and its BiasAddGrad: a
// recompute clone that the filter gradient reads, triggered by the bias gradient
// (both slices of a split, whose pairs the original graph does not name). This
// finds the pairs of `rewritten` itself and breaks every such path: a control edge
// from the BiasAddGrad that the original graph lacks starts at the gradient both
// nodes read instead (the waiting node still runs after the gradient); any other
// control edge on the path that the original lacks is taken back; and a path left
// (none is known) keeps the pair apart, listed in `unmerged`.
absl::Status BreakMergeCycles(const tensorflow::GraphDef& original,
                              tensorflow::GraphDef* rewritten, MergeGuardResult* result);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_ONEDNN_MERGE_GUARD_H_
