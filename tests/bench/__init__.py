"""The benchmark suites and the speed gate."""
