// Raw-NCCL transport: all-to-all as grouped send/recv, NCCL's own all-gather and
// reduce-scatter. Every NCCL call is checked; errors carry NCCL's message and file:line.
#include "comm/nccl_comm.h"

#include <cstring>
#include <utility>

#include "cuda/cuda_check.h"

namespace qcoll {

using namespace nccl;

namespace {

// ncclGroupStart/End pair; the destructor closes a group left open by a failed call, so
// NCCL's group depth stays balanced for the next collective.
class Group {
 public:
  Group(const NcclApi& api, ncclComm_t comm) : api_(api), comm_(comm) {
    QCOLL_NCCL_CHECK_COMM(api_.ncclGroupStart(), comm_);
  }
  void end() {
    open_ = false;
    QCOLL_NCCL_CHECK_COMM(api_.ncclGroupEnd(), comm_);
  }
  ~Group() {
    if (open_) api_.ncclGroupEnd();
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

 private:
  const NcclApi& api_;
  ncclComm_t comm_;
  bool open_ = true;
};

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kBytes: break;  // raw bytes are never reduced
  }
  throw ArgumentError("NCCL reduce_scatter: unknown dtype code " +
                      std::to_string(static_cast<int>(t)));
}

}  // namespace

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int size,
                                   std::vector<bool> member_is_local, int device)
    : Communicator(rank, size, std::move(member_is_local)), api_(nccl_api()), device_(device) {
  QCOLL_ARG_CHECK(unique_id.size() == static_cast<size_t>(kUniqueIdBytes),
                  "NCCL unique id must be ", kUniqueIdBytes, " bytes, got ", unique_id.size());
  QCOLL_ARG_CHECK(device >= 0, "NCCL communicator device index ", device, " < 0");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  cuda::DeviceGuard guard(device_);  // NCCL binds the communicator to the current device
  const ncclResult_t r = api_.ncclCommInitRank(&comm_, size, id, rank);
  if (r != ncclSuccess) {
    // A failed init may still hand back a communicator in error state: abort frees it
    // (the destructor does not run for a throwing constructor).
    try {
      nccl_fail(r, "ncclCommInitRank", __FILE__, __LINE__, comm_);
    } catch (...) {
      if (comm_) api_.ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
  }
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy();
  } catch (...) {
    // No CUDA any more (process exit), or NCCL failed: its resources go with the process.
  }
}

void NcclCommunicator::destroy() {
  if (!comm_) return;
  ncclComm_t c = comm_;
  comm_ = nullptr;  // unusable from here on, even if NCCL reports an error below
  cuda::DeviceGuard guard(device_);
  ncclResult_t async = ncclSuccess;
  api_.ncclCommGetAsyncError(c, &async);
  // Destroy waits for queued work, which never ends once a peer failed: abort instead.
  if (async != ncclSuccess)
    QCOLL_NCCL_CHECK(api_.ncclCommAbort(c));
  else
    QCOLL_NCCL_CHECK(api_.ncclCommDestroy(c));
}

void NcclCommunicator::abort() {
  if (!comm_) return;
  ncclComm_t c = comm_;
  comm_ = nullptr;
  QCOLL_NCCL_CHECK(api_.ncclCommAbort(c));
}

cudaStream_t NcclCommunicator::stream_of(const Device& dev) const {
  QCOLL_CHECK(comm_ != nullptr, "NCCL communicator was aborted");
  QCOLL_ARG_CHECK(dev.kind == DeviceKind::kCUDA && dev.index == device_,
                  "NCCL communicator of cuda:", device_, " got buffers on ",
                  dev.kind == DeviceKind::kCUDA ? "cuda:" : "cpu:", dev.index);
  return static_cast<cudaStream_t>(dev.stream);
}

void NcclCommunicator::do_all_to_all(BufferRef send, BufferRef recv, int64_t bytes_per_peer,
                                     const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  if (bytes_per_peer == 0) return;
  cuda::DeviceGuard guard(device_);
  const size_t n = static_cast<size_t>(bytes_per_peer);
  const char* s = static_cast<const char*>(send.ptr);
  char* r = static_cast<char*>(recv.ptr);
  const size_t self = n * static_cast<size_t>(rank());
  // Own block: a device copy on the same stream rather than a send to self through NCCL.
  if (s != r)
    QCOLL_CUDA_CHECK(cudaMemcpyAsync(r + self, s + self, n, cudaMemcpyDeviceToDevice, stream));
  if (size() == 1) return;
  // One group: all sends and receives progress together (no ordering deadlock).
  Group group(api_, comm_);
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    const size_t off = n * static_cast<size_t>(p);
    QCOLL_NCCL_CHECK_COMM(api_.ncclSend(s + off, n, ncclUint8, p, comm_, stream), comm_);
    QCOLL_NCCL_CHECK_COMM(api_.ncclRecv(r + off, n, ncclUint8, p, comm_, stream), comm_);
  }
  group.end();
}

void NcclCommunicator::do_all_gather(BufferRef send, BufferRef recv, int64_t bytes,
                                     const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_CHECK_COMM(api_.ncclAllGather(send.ptr, recv.ptr, static_cast<size_t>(bytes),
                                           ncclUint8, comm_, stream),
                        comm_);
}

void NcclCommunicator::do_reduce_scatter(BufferRef send, BufferRef recv, int64_t count,
                                         DType dtype, ReduceOp op, const Device& dev) {
  const cudaStream_t stream = stream_of(dev);
  const ncclDataType_t type = nccl_type(dtype);
  // ncclAvg (and bfloat16) arrived in NCCL 2.10; older libraries would reject them with a
  // less helpful "invalid argument".
  QCOLL_CHECK(api_.version >= kVersionWithAvg ||
                  (op == ReduceOp::kSum && dtype != DType::kBFloat16),
              "NCCL ", nccl_version_name(api_.version), " at ", api_.path,
              " has no ", op == ReduceOp::kAvg ? "average" : "bfloat16",
              " reduction; qcoll needs NCCL >= 2.10 for it");
  if (count == 0) return;
  const ncclRedOp_t nop = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
  cuda::DeviceGuard guard(device_);
  QCOLL_NCCL_CHECK_COMM(api_.ncclReduceScatter(send.ptr, recv.ptr, static_cast<size_t>(count),
                                               type, nop, comm_, stream),
                        comm_);
}

}  // namespace qcoll
