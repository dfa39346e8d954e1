// qcoll._cuda_emu: the CUDA kernels of src/cuda run on the CPU by the SIMT emulator, behind
// the same entry points and arguments as qcoll._C (python/kernel_bindings.h) with device
// kind CUDA, on host memory. Each call registers the bytes its arguments allow the kernels
// to touch (extents.h); configure() picks the schedule and the block sample, last_call()
// tells what ran and (when tracked) which global bytes were written.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "emu/extents.h"
#include "emu/runtime.h"
#include "emu/selftest.h"
#include "kernel_bindings.h"

namespace py = pybind11;
namespace emu = qcoll::emu;

namespace {

struct LastCall {
  std::vector<emu::LaunchRecord> launches;
  std::vector<std::pair<uintptr_t, size_t>> writes;
};

LastCall& last() {
  static LastCall l;
  return l;
}

py::dict last_call() {
  py::list launches;
  for (const auto& l : last().launches)
    launches.append(py::make_tuple(l.kernel, l.grid.x, l.block.x, l.blocks_run,
                                   l.requested_grid_x));
  py::dict d;
  d["launches"] = launches;
  d["writes"] = last().writes;
  return d;
}

}  // namespace

PYBIND11_MODULE(_cuda_emu, m) {
  m.doc() = "qcoll's CUDA kernels executed by the CPU SIMT emulator (tests only)";
  py::register_exception<emu::EmuError>(m, "EmuError", PyExc_RuntimeError);
  qcoll::binding::bind_kernels(
      m,
      [](const auto& args, auto entry) {
        emu::take_launches();
        emu::take_writes();
        emu::set_buffers(emu::extents(args));
        try {
          entry(args);
        } catch (...) {
          emu::set_buffers({});
          last() = {emu::take_launches(), emu::take_writes()};
          throw;
        }
        emu::set_buffers({});
        last() = {emu::take_launches(), emu::take_writes()};
      },
      /*release_gil=*/false);
  m.def(
      "configure",
      [](const std::string& schedule, uint64_t seed, int64_t max_blocks, bool track_writes,
         int64_t grid_cap) {
        QCOLL_ARG_CHECK(schedule == "ordered" || schedule == "random",
                        "schedule must be 'ordered' or 'random', got '", schedule, "'");
        QCOLL_ARG_CHECK(max_blocks == 0 || max_blocks >= 4,
                        "max_blocks must be 0 (every block) or >= 4, got ", max_blocks);
        QCOLL_ARG_CHECK(grid_cap >= 0 && grid_cap <= 65535,
                        "grid_cap must be 0 (the launch code's grid) or 1..65535, got ", grid_cap);
        emu::Config c;
        c.schedule = schedule == "random" ? emu::Schedule::kRandom : emu::Schedule::kOrdered;
        c.seed = seed;
        c.max_blocks = max_blocks;
        c.track_writes = track_writes;
        c.grid_cap = grid_cap;
        emu::configure(c);
      },
      py::arg("schedule") = "ordered", py::arg("seed") = 0, py::arg("max_blocks") = 0,
      py::arg("track_writes") = false, py::arg("grid_cap") = 0);
  m.def("last_call", &last_call);
  m.def("selftest", &emu::run_selftest, py::arg("name"), py::arg("lane_mask") = 1,
        py::arg("width") = 32);
  m.attr("DEVICE_KIND") = static_cast<int>(qcoll::DeviceKind::kCUDA);
  // The AddressSanitizer build (QCOLL_EMU_ASAN) replaces the access checks (alignment,
  // shared and global races, registered bounds) by ASan's own; barriers and shuffles are
  // checked either way.
#if defined(__SANITIZE_ADDRESS__)
  m.attr("ACCESS_CHECKS") = false;
#else
  m.attr("ACCESS_CHECKS") = true;
#endif
}
