"""qcoll's test suite: a package, so test modules in different folders import each other and
tests/support as tests.<folder>.<module> (pytest puts the repository root on sys.path)."""
