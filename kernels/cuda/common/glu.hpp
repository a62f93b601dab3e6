// Which gated activation an FFN uses (host-visible; the device formulas are in activations.cuh).
#pragma once

namespace deltaserve::kernels::cuda {

enum class GluKind {
  kSwiGlu,  // silu(gate) * up
  kSitu,    // [beta·tanh(gate/beta)·sigmoid(gate)] · [beta_linear·tanh(up/beta_linear)]
};

}  // namespace deltaserve::kernels::cuda
