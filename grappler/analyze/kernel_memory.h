// Analyze: memory TF's kernels allocate beyond their graph outputs.
//
// A kernel may allocate scratch while it runs (OpKernelContext::allocate_temp),
// and a oneDNN kernel may hand a buffer to a later kernel outside the graph (a
// workspace). Neither is a graph tensor, but both count in the allocator's peak.
// Each effect modelled here is named after the TF kernel it comes from, with
// the source it was read from, and pinned by a test in tests/test_memory_model.py:
//
//  * MaxPoolGrad (Eigen, without oneDNN): a copy of the pooled output and its
//    int64 argmax as scratch (maxpooling_op.cc);
//  * MaxPool with oneDNN: a workspace output read by MaxPoolGrad
//    (mkl_maxpooling_op.cc);
//  * Conv2DBackpropFilter and Conv2DBackpropInput on the CPU without oneDNN
//    (TF_ENABLE_ONEDNN_OPTS=0, or half on a CPU oneDNN does not take it on): the
//    im2col buffer of a shard of images (conv_grad_filter_ops.cc,
//    conv_grad_input_ops.h);
//  * Einsum: transposed copies of the operands, the contraction's result before
//    its transpose to the output's layout, reduced and strided copies
//    (linalg/einsum_op_impl.h);
//  * a call XLA compiles on the CPU (_XlaMustCompile) whose function takes the
//    filter gradient of a grouped convolution: XLA's ConvolutionGroupConverter
//    computes the dense, ungrouped filter gradient and masks it, in the
//    executable's temp allocation.
#ifndef TFMEMOPT_GRAPPLER_ANALYZE_KERNEL_MEMORY_H_
#define TFMEMOPT_GRAPPLER_ANALYZE_KERNEL_MEMORY_H_

#include "grappler/analyze/tensor_table.h"
#include "tensorflow/core/framework/function.pb.h"
#include "tensorflow/core/grappler/costs/graph_properties.h"

namespace tfmemopt {

// Sets NodeInfo::temp_bytes: the most scratch each kernel holds at once, beyond
// its outputs. Runs once the table's tensors and edges exist. `library` holds the
// bodies of called functions (function_bodies.h), where known.
void EstimateKernelScratch(const tensorflow::grappler::GraphProperties& properties,
                           const tensorflow::FunctionDefLibrary& library,
                           TensorTable* table);

// Adds the buffers kernels hand to later kernels outside the graph
// (NodeInfo::extra_buffers), once the table's buffers exist.
void AddKernelBuffers(TensorTable* table);

// Whether MaxPoolGrad `grad` reads oneDNN's workspace: its pooled input (input 1)
// comes straight from a float MaxPool on a CPU with oneDNN. A rewrite that makes it
// read a copy instead (a swap-in) breaks the link TF's oneDNN layout pass follows,
// and the kernel then takes Eigen's path (MaxPoolGradScratchBytes).
bool UsesOneDnnWorkspace(const TensorTable& table, const NodeInfo& grad);

// The scratch of Eigen's MaxPoolGrad: a copy of the pooled output and its int64
// argmax, 3x its gradient input.
int64_t MaxPoolGradScratchBytes(const TensorTable& table, const NodeInfo& grad);

}  // namespace tfmemopt

#endif  // TFMEMOPT_GRAPPLER_ANALYZE_KERNEL_MEMORY_H_
