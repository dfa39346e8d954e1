# The virtual GPU (tests): qcoll's host GPU code run on the CPU. Built by every
# `pip install .` with the kernel emulator, with or without nvcc:
#  - libqcoll_cudart_emu.so: the CUDA runtime surface qcoll calls, emulated (src/testing/emu/cudart);
#  - libnccl_emu.so: an NCCL stand-in over shared memory, loaded through QCOLL_NCCL_PATH by
#    qcoll's unchanged loader (src/testing/emu/nccl);
#  - qcoll._C_emu: the core with its CUDA host code (nccl_comm.cpp, stream_lanes.cu) and
#    kernels built against both, the kernels run by the SIMT emulator on the streams.
# See README "The GPU host path on the CPU". Included by CMakeLists.txt when QCOLL_EMU is on.
option(QCOLL_VGPU "Build qcoll._C_emu, the host GPU path on the emulated runtime" ON)
option(QCOLL_VGPU_COVERAGE "Build qcoll._C_emu with gcov line coverage" OFF)
if(NOT QCOLL_VGPU)
  return()
endif()

# Each library links the shared C++ runtime first (CMakeLists.txt: qcoll_shared_cxx_runtime);
# on the GPU image's compiler _C_emu otherwise took libstdc++.a.
add_library(qcoll_cudart_emu SHARED src/testing/emu/cudart/runtime.cpp)
qcoll_shared_cxx_runtime(qcoll_cudart_emu)
target_include_directories(qcoll_cudart_emu PUBLIC src/testing/emu/cudart PRIVATE src src/testing)
target_compile_options(qcoll_cudart_emu PRIVATE -O2 -Wall -Wextra)
find_package(Threads REQUIRED)
target_link_libraries(qcoll_cudart_emu PUBLIC Threads::Threads)
set_target_properties(qcoll_cudart_emu PROPERTIES INSTALL_RPATH "$ORIGIN")

add_library(nccl_emu SHARED src/testing/emu/nccl/nccl_emu.cpp)
qcoll_shared_cxx_runtime(nccl_emu)
target_include_directories(nccl_emu PRIVATE include src src/testing)
target_compile_options(nccl_emu PRIVATE -O2 -ffp-contract=off -Wall -Wextra)
target_link_libraries(nccl_emu PRIVATE qcoll_cudart_emu rt)
set_target_properties(nccl_emu PROPERTIES INSTALL_RPATH "$ORIGIN" BUILD_RPATH "$ORIGIN")

set(QCOLL_VGPU_KERNELS src/testing/emu/kernels_quantize.cpp src/testing/emu/kernels_wire.cpp)
# The host-side CUDA sources, each included unchanged by a wrapper (src/testing/emu/cudart/host_*.cpp).
set(QCOLL_VGPU_HOST_CUDA src/testing/emu/cudart/host_nccl_comm.cpp src/testing/emu/cudart/host_stream_lanes.cpp
    src/testing/emu/cudart/host_device_info.cpp)
pybind11_add_module(_C_emu NO_EXTRAS
  src/python/bindings.cpp
  src/testing/emu/cudart/bindings.cpp
  ${QCOLL_CORE_SOURCES}
  ${QCOLL_VGPU_HOST_CUDA}
  src/testing/emu/runtime.cpp
  src/testing/emu/context.cpp
  src/testing/emu/access_hooks.cpp
  src/testing/emu/stream_launch.cpp
  ${QCOLL_VGPU_KERNELS}
)
qcoll_shared_cxx_runtime(_C_emu)
string(REPLACE ";" ", " QCOLL_CUDA_ARCH_LIST "${QCOLL_CUDA_ARCHS}")
configure_file(src/cuda/build_config.h.in
               ${CMAKE_CURRENT_BINARY_DIR}/vgpu_generated/qcoll_cuda_build_config.h)
target_include_directories(_C_emu PRIVATE src/testing/emu/cudart include src src/testing src/python
                           ${CMAKE_CURRENT_BINARY_DIR}/vgpu_generated)
target_compile_definitions(_C_emu PRIVATE QCOLL_WITH_CUDA QCOLL_EMU_STREAMS
                           QCOLL_MODULE_NAME=_C_emu QCOLL_VERSION="${QCOLL_VERSION}")
target_link_libraries(_C_emu PRIVATE qcoll_cpu_kernels qcoll_cudart_emu ${CMAKE_DL_LIBS})
target_compile_options(_C_emu PRIVATE -O2 -ffp-contract=off -Wall -Wextra -Wno-psabi)
set_target_properties(_C_emu PROPERTIES INSTALL_RPATH "$ORIGIN" BUILD_RPATH "$ORIGIN"
                      CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
# The kernel sources keep the emulator's options (CMakeLists.txt: emu_kernel_options).
if(QCOLL_VGPU_COVERAGE)  # tests/cuda/vgpu_coverage.py: line coverage of the host GPU code
  set_property(SOURCE src/testing/emu/cudart/host_nccl_comm.cpp src/testing/emu/cudart/host_stream_lanes.cpp
               src/comm/communicator.cpp src/comm/nccl_loader.cpp
               APPEND PROPERTY COMPILE_OPTIONS --coverage -O0)
  target_link_options(_C_emu PRIVATE --coverage)
endif()
install(TARGETS _C_emu qcoll_cudart_emu nccl_emu LIBRARY DESTINATION .)
