#include "core/error.h"

namespace moebius {

std::string Error::what() const {
  std::string out;
  if (!file_.empty()) out += fmt::format("file '{}': ", file_);
  if (!tensor_.empty()) out += fmt::format("tensor '{}': ", tensor_);
  if (!field_.empty()) out += fmt::format("field '{}': ", field_);
  out += message_;
  return out;
}

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "moebius: internal error at %s:%d: assertion '%s' failed%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::abort();
}

}  // namespace moebius
