// Self-test kernels of the emulator (selftest_kernels.cpp): each keeps or breaks one rule.
#pragma once

#include <string>
#include <vector>

namespace qcoll {
namespace emu {

// Runs the named kernel on a fresh buffer and returns the buffer (throws EmuError when a
// check fires). lane_mask and width are used by "shuffle_xor".
std::vector<unsigned> run_selftest(const std::string& name, int lane_mask = 1, int width = 32);

}  // namespace emu
}  // namespace qcoll
