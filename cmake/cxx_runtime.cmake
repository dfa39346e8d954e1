# Where the C++ compiler's shared libstdc++ is, for linking it into the modules by path
# (CMakeLists.txt says why). Usable on its own for tests:
#   cmake -DCOMPILER=g++ -DDIRS="a;b" -P cmake/cxx_runtime.cmake   (prints the path)
#
# The unversioned libstdc++.so is the compiler's own link name, but it can be missing or a
# dangling symlink: the first GPU image's GCC in /opt/gcc had one pointing nowhere, so its
# g++ found only libstdc++.a and linked it into the module. The versioned soname the system
# installs (libstdc++.so.6) serves as well: ld reads a shared library's soname, not its file name.
function(qcoll_find_cxx_runtime out compiler dirs)
  set(found "")
  foreach(name libstdc++.so libstdc++.so.6)
    execute_process(COMMAND ${compiler} -print-file-name=${name}
                    OUTPUT_VARIABLE path OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    # The compiler prints the bare name when it finds no such file; EXISTS follows symlinks,
    # so a dangling one fails it.
    if(IS_ABSOLUTE "${path}" AND EXISTS "${path}")
      set(found "${path}")
      break()
    endif()
  endforeach()
  if(NOT found)
    # The compiler's own link directories (CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES), in order.
    foreach(dir IN LISTS dirs)
      foreach(name libstdc++.so libstdc++.so.6)
        if(EXISTS "${dir}/${name}")
          set(found "${dir}/${name}")
          break()
        endif()
      endforeach()
      if(found)
        break()
      endif()
    endforeach()
  endif()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  qcoll_find_cxx_runtime(path "${COMPILER}" "${DIRS}")
  message("${path}")
endif()
