// The core's error types and every check macro (arguments, invariants, CUDA, NCCL): a
// failed check becomes a qcoll::ArgumentError or qcoll::Error carrying file:line, which the
// binding turns into a Python exception. The CUDA / NCCL macros expand only where
// cuda_runtime_api.h / qcoll/nccl_api.h are included.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace qcoll {

// Bad argument from the caller (maps to ValueError in Python).
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Anything else that went wrong at run time (maps to RuntimeError).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A collective's transport failed: a peer died or timed out, or the communicator was aborted
// for it (maps to qcoll.CommunicationError, a RuntimeError: the one type for every transport,
// whether the failure is seen when the call is enqueued or later through its Work).
class CommunicationError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const char* file, int line, Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  return os.str();
}
}  // namespace detail

}  // namespace qcoll

// QCOLL_ARG_CHECK(cond, "group_size must be ...", value): caller's mistake.
#define QCOLL_ARG_CHECK(cond, ...)                                                   \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::qcoll::ArgumentError(::qcoll::detail::concat(__FILE__, __LINE__, __VA_ARGS__)); \
  } while (0)

// QCOLL_CHECK(cond, ...): internal invariant or runtime failure.
#define QCOLL_CHECK(cond, ...)                                                       \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::qcoll::Error(::qcoll::detail::concat(__FILE__, __LINE__, __VA_ARGS__)); \
  } while (0)

// QCOLL_CUDA_CHECK(cudaStreamSynchronize(s)): a failed CUDA runtime call.
#define QCOLL_CUDA_CHECK(expr)                                                          \
  do {                                                                                  \
    const cudaError_t qcoll_err_ = (expr);                                              \
    QCOLL_CHECK(qcoll_err_ == cudaSuccess, "CUDA error ", cudaGetErrorName(qcoll_err_), \
                ": ", cudaGetErrorString(qcoll_err_), " in ", #expr);                   \
  } while (0)

// QCOLL_NCCL_CHECK(api.ncclGroupEnd()): NCCL's status, with its messages (nccl::nccl_fail);
// _COMM adds the communicator's asynchronous error.
#define QCOLL_NCCL_CHECK(expr) QCOLL_NCCL_CHECK_COMM(expr, nullptr)
#define QCOLL_NCCL_CHECK_COMM(expr, comm)                                                  \
  do {                                                                                     \
    const ::qcoll::nccl::ncclResult_t qcoll_nccl_res_ = (expr);                            \
    if (qcoll_nccl_res_ != ::qcoll::nccl::ncclSuccess)                                     \
      ::qcoll::nccl::nccl_fail(qcoll_nccl_res_, #expr, __FILE__, __LINE__, (comm));        \
  } while (0)
