// Analyze: the while-loops of the graph and the TensorLists they fill.
//
// Grappler sees TF2's functional While lowered (by the function optimizer, before
// custom passes run) into frames of Enter / Merge / Switch / NextIteration / Exit
// nodes, the body and condition inlined. A frame's nodes run once per iteration,
// which a table of tensors cannot show: what matters for memory is what a loop keeps
// across iterations, the TensorLists it fills (control flow v2's accumulators, whose
// elements the gradient loop pops in reverse, and TensorArrays written per step).
//
// For each frame this finds:
//  * its trip count: from the condition (a counter from a constant start, stepped
//    by a constant, compared with Less/LessEqual/Greater against a value that is
//    constant or carried unchanged through the loop, or against the final value of
//    another loop's counter, as a gradient loop compares with its forward loop's);
//    else from `assume_trip_count`; else unknown;
//  * its list instances: a list created outside (EmptyTensorList,
//    TensorListReserve) and brought in by an Enter, filled by TensorListPushBack or
//    TensorListSetItem in the body. Capacity: TensorListReserve's num_elements,
//    else the trip count times the pushes per iteration, bounded by
//    EmptyTensorList's max_num_elements. Each instance's pops (TensorListPopBack in
//    a gradient loop) are found through its buffer.
// The table's list buffers are sized as capacity x item bytes (see
// BindLoopLists in tensor_table.cc), and the planner swaps accumulators from here.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_LOOPS_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_LOOPS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

struct TensorTable;

struct LoopFrame {
  std::string name;  // the Enter nodes' frame_name
  std::vector<int> enters, exits;  // table node indices
  int loop_cond = -1;
  // A gradient loop (its nodes are in the backward pass).
  bool backward = false;
  int parallel_iterations = 1;
  // -1: unknown. Source: "condition", "assume_trip_count" or "" (unknown).
  int64_t trip_count = -1;
  std::string trip_count_source;
  std::vector<int> lists;  // indices into LoopAnalysis::lists
};

// One TensorList that a loop fills.
struct ListInstance {
  int loop = -1;     // index into LoopAnalysis::loops
  int enter = -1;    // the Enter that brings the new list into the loop: owns its buffer
  int creator = -1;  // EmptyTensorList or TensorListReserve, outside the loop
  int buffer = -1;   // the table buffer the instance's tensors share
  std::vector<int> pushes;  // TensorListPushBack / TensorListSetItem nodes in the body
  int item = -1;            // the tensor the (first) push stores
  std::vector<int> pops;    // TensorListPopBack nodes (of any loop) that read it
  // Elements the list holds when the loop is done; -1: unknown. Source:
  // "num_elements", "trip_count", "max_num_elements" or "".
  int64_t capacity = -1;
  std::string capacity_source;
  // The items are references to memory held elsewhere (a variable read, a
  // constant, an element of another list): the list itself adds nothing.
  bool referenced = false;
};

struct LoopAnalysis {
  std::vector<LoopFrame> loops;
  std::vector<ListInstance> lists;
  // The loop (index into loops) of each table node, -1 outside every loop (for a
  // nested loop, the innermost).
  std::vector<int> loop_of_node;
};

// The op that stores item `*item_port` into its list input 0 (PushBack: 1,
// SetItem: 2), or false.
bool IsListWrite(const tensorflow::NodeDef& node, int* item_port);

// Finds the loops and list instances of `table` (built from `graph`; its buffers
// bound, list sizes not yet). `assume_trip_count` > 0 stands in for trip counts
// the condition does not give.
absl::Status AnalyzeLoops(const tensorflow::GraphDef& graph, const TensorTable& table,
                          int64_t assume_trip_count, LoopAnalysis* analysis);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_LOOPS_H_
