// One error type and one check macro for the whole core: every failed check becomes a
// qcoll::Error carrying file:line, which the binding turns into a Python exception.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace qcoll {

// Bad argument from the caller (maps to ValueError in Python).
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Anything else that went wrong at run time (maps to RuntimeError).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string concat(const char* file, int line, Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  return os.str();
}
}  // namespace detail

}  // namespace qcoll

// QCOLL_ARG_CHECK(cond, "group_size must be ...", value): caller's mistake.
#define QCOLL_ARG_CHECK(cond, ...)                                                   \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::qcoll::ArgumentError(::qcoll::detail::concat(__FILE__, __LINE__, __VA_ARGS__)); \
  } while (0)

// QCOLL_CHECK(cond, ...): internal invariant or runtime failure.
#define QCOLL_CHECK(cond, ...)                                                       \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::qcoll::Error(::qcoll::detail::concat(__FILE__, __LINE__, __VA_ARGS__)); \
  } while (0)
