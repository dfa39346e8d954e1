// qcoll's own declarations of the few NCCL types and entry points it uses. NCCL is loaded
// at run time (src/comm/nccl_loader.cpp), preferably the libnccl that torch already
// loaded: no nccl.h at build time, no second NCCL in the process. Types and values match
// nccl.h (stable ABI since NCCL 2.x); they live in qcoll::nccl so a TU that also includes
// the real nccl.h does not clash.
#pragma once

#include <cstddef>
#include <string>

#include "qcoll/error.h"  // QCOLL_NCCL_CHECK

// cudaStream_t is `struct CUstream_st*`; declared here so this header needs no CUDA headers.
struct CUstream_st;

namespace qcoll {
namespace nccl {

using ncclComm_t = struct ncclComm*;  // opaque
using cudaStream_t = ::CUstream_st*;

inline constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
};

enum ncclRedOp_t : int {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,  // NCCL >= 2.10
};

// NCCL_VERSION_CODE of the first releases with ncclAvg and ncclBfloat16.
inline constexpr int kVersionWithAvg = 21000;
// First release with ncclCommInitRankConfig (nonblocking communicators) and ncclCommFinalize.
inline constexpr int kVersionWithConfig = 21400;

inline constexpr int kConfigUndefInt = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT (INT_MIN)

// ncclConfig_t exactly as NCCL 2.14 laid it out (ncclConfig_v21400), what
// NCCL_CONFIG_INITIALIZER filled in then. Later NCCLs read `version` and give every field
// added after 2.14 its default (they overwrite the bytes of `tail_padding`, which is the
// 2.14 struct's tail padding), so this one layout is valid for every NCCL >= 2.14.
struct ncclConfigV21400 {
  size_t size = sizeof(ncclConfigV21400);
  unsigned int magic = 0xcafebeef;
  unsigned int version = kVersionWithConfig;
  int blocking = kConfigUndefInt;
  int tail_padding = kConfigUndefInt;
};
static_assert(sizeof(ncclConfigV21400) == 24, "ncclConfig_v21400 is 24 bytes");

using ncclGetVersion_t = ncclResult_t (*)(int* version);
using ncclGetUniqueId_t = ncclResult_t (*)(ncclUniqueId* id);
using ncclCommInitRank_t = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                            int rank);
using ncclCommInitRankConfig_t = ncclResult_t (*)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                  int rank, ncclConfigV21400* config);
using ncclCommFinalize_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommDestroy_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommAbort_t = ncclResult_t (*)(ncclComm_t comm);
using ncclCommGetAsyncError_t = ncclResult_t (*)(ncclComm_t comm, ncclResult_t* async_error);
using ncclGetErrorString_t = const char* (*)(ncclResult_t result);
using ncclGetLastError_t = const char* (*)(ncclComm_t comm);
using ncclGroupStart_t = ncclResult_t (*)();
using ncclGroupEnd_t = ncclResult_t (*)();
using ncclSend_t = ncclResult_t (*)(const void* buf, size_t count, ncclDataType_t type, int peer,
                                    ncclComm_t comm, cudaStream_t stream);
using ncclRecv_t = ncclResult_t (*)(void* buf, size_t count, ncclDataType_t type, int peer,
                                    ncclComm_t comm, cudaStream_t stream);
using ncclAllGather_t = ncclResult_t (*)(const void* send, void* recv, size_t sendcount,
                                         ncclDataType_t type, ncclComm_t comm,
                                         cudaStream_t stream);
using ncclReduceScatter_t = ncclResult_t (*)(const void* send, void* recv, size_t recvcount,
                                             ncclDataType_t type, ncclRedOp_t op,
                                             ncclComm_t comm, cudaStream_t stream);

// The loaded library. Every pointer is non-null except ncclGetLastError (NCCL >= 2.13),
// ncclCommInitRankConfig and ncclCommFinalize (NCCL >= 2.14; NcclCommunicator needs them).
struct NcclApi {
  ncclGetVersion_t ncclGetVersion = nullptr;
  ncclGetUniqueId_t ncclGetUniqueId = nullptr;
  ncclCommInitRank_t ncclCommInitRank = nullptr;
  ncclCommInitRankConfig_t ncclCommInitRankConfig = nullptr;  // optional
  ncclCommFinalize_t ncclCommFinalize = nullptr;              // optional
  ncclCommDestroy_t ncclCommDestroy = nullptr;
  ncclCommAbort_t ncclCommAbort = nullptr;
  ncclCommGetAsyncError_t ncclCommGetAsyncError = nullptr;
  ncclGetErrorString_t ncclGetErrorString = nullptr;
  ncclGetLastError_t ncclGetLastError = nullptr;  // optional
  ncclGroupStart_t ncclGroupStart = nullptr;
  ncclGroupEnd_t ncclGroupEnd = nullptr;
  ncclSend_t ncclSend = nullptr;
  ncclRecv_t ncclRecv = nullptr;
  ncclAllGather_t ncclAllGather = nullptr;
  ncclReduceScatter_t ncclReduceScatter = nullptr;

  int version = 0;   // NCCL_VERSION_CODE, e.g. 22803 for 2.28.3
  std::string path;  // the file dlopen'ed
};

// Loads NCCL once per process (thread-safe). Throws qcoll::Error saying what was tried when
// no usable library is found; a later call tries again.
// Search order: $QCOLL_NCCL_PATH; else the libnccl.so* already mapped in this process
// (torch's); else dlopen("libnccl.so.2").
const NcclApi& nccl_api();

// "2.28.3" for version code 22803 (and 2.8.4 for the old code 2804).
std::string nccl_version_name(int code);

// Version of the NCCL nccl_api() loads, or "" when none can be loaded. Never throws.
std::string nccl_version_string();

// A fresh ncclUniqueId as kUniqueIdBytes raw bytes, for rank 0 to share with the others.
std::string nccl_unique_id();

// Throws qcoll::Error for a failed NCCL call, with NCCL's error string, its last-error
// message and, when `comm` is given, the communicator's asynchronous error.
[[noreturn]] void nccl_fail(ncclResult_t result, const char* expr, const char* file, int line,
                            ncclComm_t comm = nullptr);

}  // namespace nccl
}  // namespace qcoll
