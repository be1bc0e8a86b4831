// Rewrite (test-only): hold a buffer through a changed graph's step, memory the
// prediction does not count.
//
// The feedback loop's last resort, running a step as TF built it after its plans ran
// out of memory (python/tfmemopt/feedback.py: after_failed_attempt), is for plans that
// are wrong about real memory. Such plans are rare and depend on the machine, so the
// tests make one: with `test_only_hold_bytes` set, every graph the pass changes also
// makes a buffer of that many bytes before any other op and keeps it until the
// step's fetches and kept ops have run. A budget that the original step meets with less room
// than that to spare then runs out of memory with every plan, and trains as TF built
// it. Nothing the step computes reads the buffer; the graph's results are unchanged.

#ifndef TFMEMOPT_GRAPPLER_REWRITE_TEST_ONLY_HOLD_H_
#define TFMEMOPT_GRAPPLER_REWRITE_TEST_ONLY_HOLD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tfmemopt {

inline constexpr char kTestOnlyHoldScope[] = "TfMemOpt/TestOnlyHold/";

// Adds TfMemOpt/TestOnlyHold/{shape,condition,stamp,value,buffer,keep} to `graph`:
// buffer = Fill(shape, value), doubles, `bytes` rounded up to 8, value =
// ZerosLike(Timestamp) (not a constant, so never folded); keep = Assert(condition,
// [buffer]) after what each node of `wait_for` (the item's fetch and keep_ops: nodes
// outside loops) reads. Assert is stateful, so that TF's function runtime neither
// folds nor prunes it. All on the device of the graph's first placed node. A graph
// that has them already is left as it is.
absl::Status AddTestOnlyHold(int64_t bytes, const std::vector<std::string>& wait_for,
                             tensorflow::GraphDef* graph);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_REWRITE_TEST_ONLY_HOLD_H_
