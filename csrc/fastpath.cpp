// The C++ fast path of the sparse products in compiled graphs (torch_sparserl/jit/fastpath.py).
//
// On a small graph a product is bound by the CPU, and its Python implementation (argument
// checks, pattern lookup, the runtime's decision, the launch through ctypes) costs tens of
// microseconds. This library serves the CUDA products in C++, through three doors:
//
//   - the CUDA kernels of `sparserl::{spmm,spmv,spmm_transposed,spmv_transposed}` (eager calls
//     of the operators, under autograd too, and the backward products);
//   - the same for `sparserl_fast::*` (compiled graphs, after AOTAutograd);
//   - `serve()`, a Python function of this module, which an eager `A @ X` on a CSRMatrix calls
//     without the dispatcher (it declines what needs autograd, autocast or a mode).
//
// And one door into the library's matrices: `intake()`, which ts.csr of CUDA indices calls to
// check their metadata, allocate the library's copies and launch the fused kernel that copies
// and checks them (intake.h).
//
// Every door looks its operands up in a registry that the Python implementation fills after it
// has served the same call itself:
//
//   hit   the same crow and col tensors (identity, alive, unmodified: version counters), the
//         same op, ncols, N and dtype, operands of the recorded sizes  -> the installed kernel is
//         launched from here, through its library's C launcher or, for a kernel the runtime
//         serves from its NVRTC build while that library is built, through the driver's
//         cuLaunchKernel (or cuSPARSE, where the runtime decided no kernel beats it);
//   miss  anything else  -> `sparserl_direct::<op>`, the Python implementation, which checks,
//         raises the operators' errors, decides, and records what served the call (serve()
//         returns None instead: its caller runs the Python path).
//
// Nothing here decides or validates a pattern: an entry only repeats what the Python path did
// for the same operands. The registry is emptied whenever the runtime changes.
//
// Young patterns: a pattern this library staged itself (stage_csr: host arrays checked on their
// private copy), which the runtime leaves to cuSPARSE while it is younger than its admission age
// (jit.admit_age_s), is served here by cuSPARSE on its own arrays (cusparse_once) until that age,
// with no Python: the products of a sampled mini-batch. Its first transposed product too, through
// cuSPARSE's transpose operation, as the Python path would (ops: _transposed_once).
//
// Built by torch.utils.cpp_extension (C++ against the CUDA runtime API: kernels are launched
// through the C launchers of the libraries torch_sparserl.toolchain.inline builds, or as driver
// functions (CUfunction) of NVRTC builds; no CUDA code is compiled here).
//
// One translation unit, written as parts of one concern each (csrc/README.md maps them),
// included at the end of this file, each after the parts whose names it uses: torch's headers
// are parsed once, every name stays in this unit's anonymous namespace (the library exports
// its module's init function alone), and the compiler sees the whole hot path.

#include <Python.h>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_sparse_csr_tensor_unsafe.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/addmv.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#if __has_include(<cusparse.h>)
#include <cusparse.h>
#include <dlfcn.h>
#include <link.h>
#define SPARSERL_CUSPARSE 1
// torch's cuSPARSE handle of the current device, set to the current stream (libtorch_cuda;
// declared here: its header, ATen/cuda/CUDAContextLight.h, needs cuBLAS and cuSOLVER headers too)
namespace at::cuda {
cusparseHandle_t getCurrentCUDASparseHandle();
}
#else  // no cuSPARSE header here: cuSPARSE is reached through at::addmm / at::addmv only
#define SPARSERL_CUSPARSE 0
#endif

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fastpath/registry.h"
#include "fastpath/young.h"
#include "fastpath/cusparse_calls.h"
#include "fastpath/serving.h"
#include "fastpath/registry_ops.h"
#include "fastpath/host_probes.h"
#include "fastpath/staging.h"
#include "fastpath/eager_door.h"
#include "fastpath/intake.h"
#include "fastpath/library.h"
