"""Does a built extension module use the shared C++ runtime, as it must?

A module that links libstdc++.a (found on the linker's search path before the compiler's own
libstdc++.so, or asked for with -static-libstdc++) carries a second copy of the runtime and
exports it. Once another libstdc++ is in the process (torch's), iostreams mix the two copies'
locale facets and std::ostringstream crashes or writes nothing: qcoll's first GPU build died
that way in its first error message. So: the module must NEED the shared runtime and define
none of the symbols that only the runtime itself defines.

    python cmake/check_cxx_runtime.py [--readelf PATH] [--report] [--delete] MODULE.so...

Exit 1 (with the reason) when a module fails; --delete then removes it, so that neither an
install nor the next build (which would find it up to date) picks it up. --report also
prints each module's facts.
CMakeLists.txt runs it after linking each module; tests/packaging/test_cxx_runtime.py and
bench/gpu/link_report.py use it too. Needs only readelf (binutils) and the standard library.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# Sonames of the shared C++ runtimes (GCC's, LLVM's).
RUNTIME_SONAMES = ("libstdc++.so", "libc++.so")
# Mangled-name prefixes only the runtime library defines: std::basic_ostream<char> and
# std::ios_base members (explicitly instantiated there, `extern template` in its headers),
# std::locale (no template), and the exception ABI (libsupc++).
RUNTIME_ONLY = ("_ZNSo", "_ZNKSo", "_ZNSt8ios_base", "_ZNKSt8ios_base", "_ZNSt6locale",
                "_ZNKSt6locale", "__gxx_personality_v0", "__cxa_throw")
# Any member of namespace std (informational: a module may define template instances).
STD_PREFIX = re.compile(r"_ZN?K?S[a-z]")


def _readelf(readelf: str, *args: str) -> str:
    return subprocess.run([readelf, "-W", *args], check=True, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE).stdout


def needed(path: str, readelf: str = "readelf") -> list[str]:
    """The module's DT_NEEDED entries."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf(readelf, "-d", path))


def defined_dynamic_symbols(path: str, readelf: str = "readelf") -> list[str]:
    """Names the module defines and exports (its .dynsym entries that are not UND)."""
    names = []
    for line in _readelf(readelf, "--dyn-syms", path).splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(fields) >= 8 and fields[0].endswith(":") and fields[6] != "UND":
            names.append(fields[7].split("@")[0])
    return names


def problems(path: str, readelf: str = "readelf") -> list[str]:
    """Why `path` does not use the shared C++ runtime properly; empty when it does."""
    found = []
    deps = needed(path, readelf)
    if not any(dep.startswith(RUNTIME_SONAMES) for dep in deps):
        found.append(f"needs no shared C++ runtime (NEEDED: {', '.join(deps) or 'nothing'})")
    own = sorted(name for name in defined_dynamic_symbols(path, readelf)
                 if name.startswith(RUNTIME_ONLY))
    if own:
        found.append(f"defines {len(own)} symbols of the C++ runtime itself, e.g. "
                     + ", ".join(own[:4]))
    return found


def report(path: str, readelf: str = "readelf") -> str:
    """A few lines for a log: NEEDED, how many std:: / runtime-only symbols it defines."""
    names = defined_dynamic_symbols(path, readelf)
    std = [n for n in names if STD_PREFIX.match(n)]
    own = [n for n in names if n.startswith(RUNTIME_ONLY)]
    return (f"{path}\n  NEEDED: {', '.join(needed(path, readelf))}\n"
            f"  defined dynamic symbols: {len(names)}; in std: {len(std)}; "
            f"the runtime's own: {len(own)} {sorted(own)[:8]}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--readelf", default="readelf")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--delete", action="store_true")
    args = parser.parse_args(argv)
    failed = False
    for module in args.modules:
        if args.report:
            print(report(module, args.readelf))
        found = problems(module, args.readelf)
        for problem in found:
            print(f"error: {module} {problem}.", file=sys.stderr)
        if found and args.delete:
            os.remove(module)
        failed = failed or bool(found)
    if failed:
        print("A static libstdc++ was linked into the module: its iostreams crash once another "
              "libstdc++ (torch's) is in the process. Look for a libstdc++.a in a -L directory "
              "of the link (the linker's -Wl,-t trace names the file it used), "
              "-static-libstdc++ in LDFLAGS, or a CUDA host compiler other than the C++ "
              "compiler; bench/gpu/link_report.py prints all three.", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
