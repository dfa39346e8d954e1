#!/bin/bash
# build_compute_rate.sh SRCDIR OUT: compute_rate.cpp against SRCDIR's CPU kernels, with the
# CPU kernel library's flags (CMakeLists.txt).
set -e
S=$1; O=$2
F="-O3 -ffp-contract=off -fno-math-errno -fno-trapping-math -fopenmp -std=c++17 -I$S/include -I$S/src"
g++ $F -c $S/src/cpu/quantize.cpp -o $O.q.o &
g++ $F -c $S/src/cpu/wire.cpp -o $O.w.o &
g++ $F -c $S/src/cpu/isa.cpp -o $O.i.o &
g++ $F -c "$(dirname "$0")/compute_rate.cpp" -o $O.h.o
wait
g++ -fopenmp $O.q.o $O.w.o $O.i.o $O.h.o -o $O
