// Rewrite: pace a loop's iterations, so that a value computed ahead of the carried
// value it is combined with does not pile up.
//
// TF's executor runs up to `parallel_iterations` iterations of a loop at once (32 in
// Keras), one loop variable independently of another. Values that depend only on
// what runs ahead (the counter, a popped list element, the loop's invariants) or on a
// carried value that runs ahead of another are computed as soon as their iteration
// reaches them; the op that combines them with the slower carried value waits, and
// they pile up. Two forms in every recurrent layer:
//  * a forward loop's input projection, MatMul(x_t, W): x_t is read from a list by
//    the counter, and the add with MatMul(h, U) waits for the recurrent state;
//  * a gradient loop's running sum of a weight's gradient, AddN(sum, MatMul(x_t,
//    dz_t)): the terms follow the recurrent gradient, the adds run one per iteration.
// Measured on a bidirectional GRU + LSTM (batch 32, 60 steps; benchmarks/
// unseen_models.py's bidirectional_gru): 25 of the LSTM's weight-gradient terms live
// at once with TF's default threads, 63 with one inter-op thread (two terms per
// iteration, 32 iterations): up to 5.9 MiB that the simulation, which runs a body
// once, does not see.
//
// PaceLoops makes each such producer wait (a control edge) for the body's read of the
// carried value its consumer combines it with: an Identity of that value's Switch
// (port 1) already in the graph (the lowering's, the loop swap's) or
// TfMemOpt/LoopPace/<Switch>. Iteration i's value is then
// computed once iteration i-1 has produced the slower one, so about one iteration's
// values are live, as the simulation assumes. Only the start times of kernels change:
// every op reads the same inputs and runs the same kernel, so the results are bitwise
// those of the original.
//
// Rule, in a loop frame with parallel_iterations > 1: for a node C of the body (not
// control flow) with two or more inputs, and each input's producer P (through
// Identities; a node of the same frame, not control flow, not Const, not stateful, a
// TensorList op only to read one element, that already waits on the loop's predicate,
// so it is dead when the loop exits as its new control input is): if C reads, within
// the iteration, a carried float value V (a Merge with a NextIteration input, through
// its Switch; the counter, lists and resources run ahead by design and are not waited
// for) that P does not read, and V's Switch does not wait for P (which would close a
// cycle), P waits for V's read.

#ifndef TFMEMOPT_GRAPPLER_REWRITE_LOOP_PACING_H_
#define TFMEMOPT_GRAPPLER_REWRITE_LOOP_PACING_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

struct TensorTable;

// The Identities the stage adds where no Identity reads a carried value's Switch.
inline constexpr char kLoopPaceScope[] = "TfMemOpt/LoopPace/";

struct LoopPacingResult {
  int values = 0;  // carried values that some producer now waits for
  // (waited for, waiting): the body's read of a carried value, the producer.
  std::vector<std::pair<std::string, std::string>> edges;
};

// Finds the producers of `table`'s loops (the table of the graph the pass was given)
// that may run ahead, and adds their pacing edges to `graph` (the pass's output, where
// the loops' nodes keep their names). A producer `graph` no longer has, or an edge it
// already has, is skipped.
absl::Status PaceLoops(const TensorTable& table, tensorflow::GraphDef* graph,
                          LoopPacingResult* result);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_LOOP_PACING_H_
