// Build-time capabilities and the CPU side of qcoll.build_info().
#include "qcoll/device.h"
#include "qcoll/error.h"
#include "qcoll/lanes.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace qcoll {

bool openmp_enabled() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

int openmp_max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int set_openmp_threads(int threads) {
#if defined(_OPENMP)
  const int previous = omp_get_max_threads();
  if (threads >= 1 && threads != previous) omp_set_num_threads(threads);
  return previous;
#else
  (void)threads;
  return 1;
#endif
}

#if !defined(QCOLL_WITH_CUDA)
std::unique_ptr<StreamLanes> make_stream_lanes(const Device&) {
  QCOLL_ARG_CHECK(false, "CUDA stream lanes requested but qcoll was built without CUDA");
  return nullptr;
}

bool cuda_compiled() { return false; }
std::vector<int> cuda_archs() { return {}; }
int cuda_device_count() { return 0; }
std::string cuda_runtime_version() { return ""; }
#endif

}  // namespace qcoll
