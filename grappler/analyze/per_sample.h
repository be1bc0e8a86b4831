// Analyze: which ops work on each sample of the batch on its own, so that they can
// run on slices of the batch one after another (rewrite/split_pass.h).
//
// The batch is dimension 0. An op is
//  * per-sample if row i of each of its outputs depends only on row i of its
//    batch inputs (its other inputs are used whole: weights, options): convolutions,
//    pooling, bias add, element-wise ops and activations (an input with the
//    output's rank and batch is cut, one broadcast along the batch is used whole),
//    MatMul against a weight, reshapes that keep the batch dimension, concatenation
//    along another axis (and the slices its gradient takes), selects, reductions and tiling along other axes (global pooling and
//    its gradient), softmax and the per-sample cross entropies, and the
//    gradients of these with respect to their inputs (ReluGrad, MaxPoolGrad,
//    Conv2DBackpropInput, ...). The fused forms TF's remapper produces on this
//    wheel (_FusedConv2D, _FusedMatMul, _FusedDepthwiseConv2dNative) too.
//    Also the ops that *make* a tensor along the batch from one row or less: a
//    Tile whose input has one row and whose multiples repeat it over the batch,
//    and a BroadcastTo onto the batch (the gradients of a mean or a sum over the
//    batch, as in an unfused batch normalization's). Their input is used whole and
//    each slice makes its own rows. Only when `through_batch_statistics`: the
//    slices' sums of batch normalization's gradient are nearly equal terms that
//    its backward subtracts, so their other order shows far more than elsewhere.
//  * a batch reduction if its output is a sum over the rows of per-row terms: the
//    weight gradients (Conv2DBackpropFilter, BiasAddGrad, MatMul with the batch
//    transposed, Sum over dimension 0). Only backward ops are taken as reductions:
//    the sum of the slices' partial sums changes the order of a float sum, which
//    the weight update tolerates (issue 18's stated tolerance) but a loss must not.
// Everything else mixes samples or is not known to us (BatchNorm in training, the
// loss's mean, transposes of the batch, random and stateful ops, loops) and ends a
// region. Every tensor an op cuts or produces along the batch needs a fully known
// static shape whose dimension 0 is the batch size, found from the graph's inputs.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_PER_SAMPLE_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_PER_SAMPLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grappler/analyze/control_flow.h"
#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/grappler/grappler_item.h"

namespace tfmemopt {

enum class BatchRole { kNone, kPerSample, kReduce };

struct BatchUse {
  BatchRole role = BatchRole::kNone;
  // Data input positions whose tensor is cut along the batch; the other inputs
  // are used whole.
  std::vector<int> batch_inputs;
  // Data input positions that hold the node's output shape (Reshape's shape,
  // Conv2DBackpropInput's input_sizes, AvgPoolGrad's orig_input_shape): each
  // slice gets a constant of its own.
  std::vector<int> shape_inputs;
  // A Tile's multiples input when it repeats a one-row input over the batch: each
  // slice gets the multiples with the slice's rows first.
  int multiples_input = -1;
  std::string why_not;  // kNone: why ("op", "shape", "stateful", "control_flow", ...)
};

struct BatchAnalysis {
  // The static batch size: dimension 0 of the largest graph input; 0 if unknown
  // (then nothing is split).
  int64_t batch = 0;
  std::vector<BatchUse> nodes;  // per table node
  // Per table tensor: its static shape, and whether it is fully known.
  std::vector<std::vector<int64_t>> shapes;
  std::vector<bool> shape_known;
};

// Classifies every node of `table` (built from `item`). The ops that make a tensor
// along the batch from one row are per-sample only with `through_batch_statistics`
// (else why_not "batch_statistics" in the backward pass, "op" in the forward).
absl::Status AnalyzeBatch(const tensorflow::grappler::GrapplerItem& item,
                          const TensorTable& table, const ControlFlowInfo& flow,
                          bool through_batch_statistics, BatchAnalysis* analysis);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_PER_SAMPLE_H_
