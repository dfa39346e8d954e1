// The header at the start of every wire slot: what the sender believes the exchange is.
// The receiver checks each received header against its own call before decoding, so ranks
// that disagree on size, code format or call order get an error, never wrong data (a
// short message or a missing one would otherwise leave stale workspace bytes to decode).
//
// Before any of that, the first call of each distinct signature on a communicator
// all-gathers one fixed-size CallHeader over the whole group (check_call): ranks that
// disagree on what the call is (sizes, code formats, op, stages, call number) all raise the
// same error, listing every rank's values, before any message whose size depends on those
// values is sent (gloo aborts the process when a message is longer than the receiver
// expects). A signature every member has agreed on is not exchanged again: a round trip
// per call cost more than a small call itself (issue 26). Ranks that later diverge between
// two signatures all of them used before are caught by the chunk headers (call number
// included) where sizes agree; QCOLL_DEBUG=1 checks every call.
//
// Headers are written and checked by host code, on buffers in host memory (the CPU path);
// device buffers travel without them (plans for CUDA tensors have header 0).
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#include "qcoll/comm.h"
#include "qcoll/error.h"
#include "qcoll/wire.h"

namespace qcoll {

// The call check failed: every rank raises it, nothing was exchanged but the call headers,
// and the group stays consistent (ValueError in Python).
class MismatchError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

// A received chunk is not what this rank's call expects (stale, short or misrouted data).
// Only the receiving rank knows, so the group is left mid-call (RuntimeError in Python).
class ChunkError : public Error {
 public:
  using Error::Error;
};

enum class Exchange : uint16_t { kAllGather = 1, kFlat = 2, kIntraHop = 3, kInterHop = 4 };

inline const char* exchange_name(uint16_t e) {
  switch (static_cast<Exchange>(e)) {
    case Exchange::kAllGather: return "all-gather";
    case Exchange::kFlat: return "all-to-all";
    case Exchange::kIntraHop: return "intra-node hop";
    case Exchange::kInterHop: return "inter-node hop";
  }
  return "unknown exchange";
}

inline constexpr uint32_t kChunkMagic = 0x71436f6c;  // "qCol"

// Headers carry a hadamard_size (0 or a power of two up to 256) as its log2 in one byte.
inline uint8_t hadamard_log2(int64_t size) {
  uint8_t k = 0;
  while ((int64_t{1} << k) < size) ++k;
  return k;
}

struct ChunkHeader {
  uint32_t magic = kChunkMagic;
  uint8_t exchange = 0;
  uint8_t hadamard = 0;  // log2 of the chunk's hadamard_size, 0: off
  uint8_t format = 0;    // CodeFormat (kRaw: raw values)
  uint8_t dtype = 0;  // raw / source element type
  uint32_t group_size = 0;
  uint32_t sequence = 0;  // the group's call number (same on every rank for one call)
  int64_t len = 0;        // elements in the chunk
  int32_t sender = 0;     // the sender's member index in the communicator
  int32_t stage = 0;
};
static_assert(sizeof(ChunkHeader) == 32, "wire header layout");
inline constexpr int64_t kHeaderBytes = sizeof(ChunkHeader);

// What this rank expects (and sends) for one exchange of one stage.
inline ChunkHeader make_header(Exchange exchange, const WireFormat& fmt, int64_t len,
                               uint32_t sequence, int32_t stage, int32_t sender) {
  ChunkHeader h;
  h.exchange = static_cast<uint8_t>(exchange);
  h.hadamard = hadamard_log2(fmt.hadamard_size);
  h.format = static_cast<uint8_t>(fmt.format);
  h.dtype = static_cast<uint8_t>(fmt.raw_dtype);
  h.group_size = fmt.quantized() ? static_cast<uint32_t>(fmt.group_size) : 0;
  h.sequence = sequence;
  h.len = len;
  h.stage = stage;
  h.sender = sender;
  return h;
}

// Stamp `count` slots, `stride` bytes apart.
inline void write_headers(uint8_t* slots, int64_t stride, int64_t count, const ChunkHeader& h) {
  for (int64_t k = 0; k < count; ++k) std::memcpy(slots + k * stride, &h, sizeof h);
}

inline std::string describe(const ChunkHeader& h) {
  std::ostringstream os;
  if (h.magic != kChunkMagic) {
    os << "no qcoll chunk (magic 0x" << std::hex << h.magic << std::dec << ")";
    return os.str();
  }
  os << "{call " << h.sequence << ", " << exchange_name(h.exchange) << " stage " << h.stage
     << ", ";
  const bool codes = h.format != static_cast<uint8_t>(CodeFormat::kRaw);
  os << format_name(static_cast<CodeFormat>(h.format)) << (codes ? " codes of " : " ");
  os << dtype_name(static_cast<DType>(h.dtype));
  if (codes) os << " in groups of " << h.group_size;
  if (h.hadamard) os << ", Hadamard blocks of " << (1 << h.hadamard);
  os << ", " << h.len << " elements}";
  return os.str();
}

// Check `count` received slots; slot k must come from member sender_of(k) and otherwise
// match `want`. `peer_rank(member)` names the sender for the error message.
template <typename SenderOf>
void check_headers(const uint8_t* slots, int64_t stride, int64_t count, ChunkHeader want,
                   SenderOf sender_of, int32_t self) {
  for (int64_t k = 0; k < count; ++k) {
    ChunkHeader got;
    std::memcpy(&got, slots + k * stride, sizeof got);
    want.sender = sender_of(k);
    if (std::memcmp(&got, &want, sizeof got) == 0) continue;
    std::ostringstream os;
    os << "ranks disagree on the " << exchange_name(want.exchange) << ": member "
       << want.sender << " sent " << describe(got) << ", member " << self << " (this rank) "
       << "expected " << describe(want);
    if (got.magic == kChunkMagic && got.sender != want.sender)
      os << " (the chunk claims to come from member " << got.sender << ")";
    throw ChunkError(os.str());
  }
}

// The collective a call header describes (exported as _C.CALL_KINDS).
enum class CallKind : uint8_t { kAllGather = 1, kReduceScatter = 2, kAllReduce = 3 };

inline const char* call_kind_name(CallKind k) {
  return k == CallKind::kAllGather ? "all-gather" : k == CallKind::kAllReduce ? "all-reduce"
                                                                              : "reduce-scatter";
}

// What every rank must agree on for one call, all-gathered before any payload.
struct CallHeader {
  uint32_t magic = kChunkMagic;
  uint8_t kind = 0;  // CallKind
  uint8_t dtype = 0;
  uint8_t first_format = 0;   // CodeFormat
  uint8_t second_format = 0;  // CodeFormat (kRaw without a second hop)
  uint8_t op = 0;
  uint8_t two_hop = 0;
  uint8_t stages = 0;    // the plan's stage count, clamped to 255
  uint8_t hadamard = 0;  // log2 of hadamard_size, 0: off
  uint32_t group_size = 0;
  int64_t n = 0;  // elements per rank (all-gather input, reduce-scatter output); an all-reduce's own
  uint32_t sequence = 0;
  int32_t sender = 0;
};
static_assert(sizeof(CallHeader) == 32, "call header layout");
inline constexpr int64_t kCallHeaderBytes = sizeof(CallHeader);

inline std::string describe(const CallHeader& h) {
  std::ostringstream os;
  if (h.magic != kChunkMagic) {
    os << "no qcoll call (magic 0x" << std::hex << h.magic << std::dec << ")";
    return os.str();
  }
  auto name = [](uint8_t f) { return std::string(format_name(static_cast<CodeFormat>(f))); };
  const uint8_t raw = static_cast<uint8_t>(CodeFormat::kRaw);
  const CallKind kind = static_cast<CallKind>(h.kind);
  os << call_kind_name(kind) << " call " << h.sequence << ", " << h.n << " " << dtype_name(static_cast<DType>(h.dtype))
     << (kind == CallKind::kAllReduce ? " elements, " : " elements per rank, ");
  if (kind == CallKind::kAllReduce && !h.two_hop && h.first_format == raw) {  // the transport's
    os << name(h.first_format) << ", op " << reduce_op_name(static_cast<ReduceOp>(h.op));
  } else if (kind == CallKind::kAllGather) {
    os << name(h.first_format);
  } else {
    os << (h.two_hop ? "2-hop " : "1-hop ") << name(h.first_format);
    if (h.two_hop) os << " then " << name(h.second_format);
    os << ", op " << reduce_op_name(static_cast<ReduceOp>(h.op)) << ", " << int{h.stages} << " stage(s)";
  }
  if (h.first_format != raw || (h.two_hop && h.second_format != raw))
    os << ", group_size " << h.group_size;
  if (h.hadamard) os << ", hadamard_size " << (1 << h.hadamard);
  return os.str();
}

// All-gather `mine` over `comm` through `area` ((size + 1) * kCallHeaderBytes bytes of
// workspace) and raise MismatchError, identically on every rank, unless all agree; nothing
// when the signature was agreed before on this communicator.
inline void check_call(Communicator& comm, const BufferRef& area, CallHeader mine,
                       const Device& device, Traffic& traffic) {
  const int size = comm.size();
  uint8_t* base = static_cast<uint8_t*>(area.ptr);
  CallHeader key = mine;  // the signature: the call less its number and sender
  key.sequence = 0;
  const std::string signature(reinterpret_cast<const char*>(&key), sizeof key);
  if (comm.agreed(signature)) return;
  mine.sender = comm.rank();
  std::memcpy(base + int64_t{size} * kCallHeaderBytes, &mine, sizeof mine);
  traffic.header_bytes += kCallHeaderBytes * (size - 1);
  comm.exchange_call_headers(area.at(int64_t{size} * kCallHeaderBytes), area, kCallHeaderBytes,
                             device, traffic);
  bool agree = true;
  for (int r = 0; r < size && agree; ++r) {
    CallHeader got;
    std::memcpy(&got, base + int64_t{r} * kCallHeaderBytes, sizeof got);
    got.sender = mine.sender;
    agree = std::memcmp(&got, &mine, sizeof got) == 0;
  }
  if (agree) {
    comm.add_agreed(signature);
    return;
  }
  std::ostringstream os;
  os << "ranks disagree on the call:";
  for (int r = 0; r < size; ++r) {
    CallHeader got;
    std::memcpy(&got, base + int64_t{r} * kCallHeaderBytes, sizeof got);
    os << "\n  member " << r << (r == mine.sender ? " (this rank)" : "") << ": " << describe(got);
  }
  throw MismatchError(os.str());
}

}  // namespace qcoll
