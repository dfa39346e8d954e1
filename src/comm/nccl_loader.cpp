// Finds and loads NCCL at run time (docs/design.md, decision 8). No CUDA needed here, so
// build_info can report the NCCL version from any build.
#include "qcoll/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "qcoll/error.h"

namespace qcoll {
namespace nccl {
namespace {

// Path of a libnccl.so* already mapped into this process ("" if none). torch's CUDA wheels
// load theirs from site-packages/nvidia/nccl/lib, which is not on the loader's search path,
// so dlopen("libnccl.so.2") alone would miss it or load a second, different copy.
std::string mapped_nccl_path() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');  // the path is the only field with a '/'
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (path.find(" (deleted)") != std::string::npos) continue;
    const std::string base = path.substr(path.rfind('/') + 1);
    if (base.compare(0, 10, "libnccl.so") == 0) return path;
  }
  return "";
}

void* open_library(std::string& path, std::ostringstream& tried) {
  auto attempt = [&tried](const std::string& p, int flags) -> void* {
    dlerror();
    void* h = dlopen(p.c_str(), flags);
    if (!h) {
      const char* why = dlerror();
      tried << "\n  " << p << ": " << (why ? why : "dlopen failed");
    }
    return h;
  };
  const char* env = std::getenv("QCOLL_NCCL_PATH");
  if (env && *env) {  // an explicit choice: no fallback that would hide a wrong path
    path = env;
    return attempt(path, RTLD_NOW | RTLD_LOCAL);
  }
  const std::string mapped = mapped_nccl_path();
  if (!mapped.empty()) {
    // NOLOAD returns the copy already in memory; the plain open finds it by inode anyway.
    dlerror();
    if (void* h = dlopen(mapped.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      path = mapped;
      return h;
    }
    if (void* h = attempt(mapped, RTLD_NOW | RTLD_LOCAL)) {
      path = mapped;
      return h;
    }
  }
  path = "libnccl.so.2";
  return attempt(path, RTLD_NOW | RTLD_LOCAL);
}

template <typename Fn>
void resolve(void* handle, const std::string& path, const char* name, Fn& fn, bool required) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (!sym && required) {
    const char* why = dlerror();
    throw Error(std::string("qcoll: NCCL library ") + path + " lacks symbol " + name + " (" +
                (why ? why : "not found") + "); qcoll needs NCCL >= 2.7");
  }
  fn = reinterpret_cast<Fn>(sym);
}

NcclApi load() {
  NcclApi api;
  std::ostringstream tried;
  // Never dlclose'd: NCCL keeps threads and atexit handlers for the life of the process.
  void* handle = open_library(api.path, tried);
  if (!handle)
    throw Error("qcoll: cannot load NCCL. Tried:" + tried.str() +
                "\nImport torch (with CUDA) first so its NCCL is reused, or set "
                "QCOLL_NCCL_PATH to a libnccl.so.2.");
  resolve(handle, api.path, "ncclGetVersion", api.ncclGetVersion, true);
  resolve(handle, api.path, "ncclGetUniqueId", api.ncclGetUniqueId, true);
  resolve(handle, api.path, "ncclCommInitRank", api.ncclCommInitRank, true);
  resolve(handle, api.path, "ncclCommInitRankConfig", api.ncclCommInitRankConfig, false);
  resolve(handle, api.path, "ncclCommFinalize", api.ncclCommFinalize, false);
  resolve(handle, api.path, "ncclCommDestroy", api.ncclCommDestroy, true);
  resolve(handle, api.path, "ncclCommAbort", api.ncclCommAbort, true);
  resolve(handle, api.path, "ncclCommGetAsyncError", api.ncclCommGetAsyncError, true);
  resolve(handle, api.path, "ncclGetErrorString", api.ncclGetErrorString, true);
  resolve(handle, api.path, "ncclGetLastError", api.ncclGetLastError, false);
  resolve(handle, api.path, "ncclGroupStart", api.ncclGroupStart, true);
  resolve(handle, api.path, "ncclGroupEnd", api.ncclGroupEnd, true);
  resolve(handle, api.path, "ncclSend", api.ncclSend, true);
  resolve(handle, api.path, "ncclRecv", api.ncclRecv, true);
  resolve(handle, api.path, "ncclAllGather", api.ncclAllGather, true);
  resolve(handle, api.path, "ncclReduceScatter", api.ncclReduceScatter, true);
  const ncclResult_t r = api.ncclGetVersion(&api.version);
  if (r != ncclSuccess)
    throw Error("qcoll: ncclGetVersion failed in " + api.path + ": " +
                api.ncclGetErrorString(r));
  return api;
}

}  // namespace

const NcclApi& nccl_api() {
  // C++11 magic static: one thread loads, the others wait; a throw leaves it unset.
  static const NcclApi api = load();
  return api;
}

std::string nccl_version_name(int code) {
  // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9 on.
  const bool old = code < 10000;
  return std::to_string(old ? code / 1000 : code / 10000) + "." +
         std::to_string((old ? code % 1000 : code % 10000) / 100) + "." +
         std::to_string(code % 100);
}

std::string nccl_version_string() {
  try {
    return nccl_version_name(nccl_api().version);
  } catch (...) {
    return "";
  }
}

std::string nccl_unique_id() {
  const NcclApi& api = nccl_api();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  QCOLL_NCCL_CHECK(api.ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

void nccl_fail(ncclResult_t result, const char* expr, const char* file, int line,
               ncclComm_t comm) {
  const NcclApi& api = nccl_api();  // loaded: a call through it just failed
  std::ostringstream os;
  os << "NCCL error " << static_cast<int>(result) << " (" << api.ncclGetErrorString(result)
     << ") in " << expr;
  if (api.ncclGetLastError) {
    const char* last = api.ncclGetLastError(comm);
    if (last && *last) os << ": " << last;
  }
  if (comm) {
    ncclResult_t async = ncclSuccess;
    if (api.ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess)
      os << "; communicator error: " << api.ncclGetErrorString(async);
  }
  os << " [" << file << ":" << line << "]";
  throw Error(os.str());
}

}  // namespace nccl
}  // namespace qcoll
