#include "core/tensor.h"

#include <fmt/format.h>

namespace moebius {

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += fmt::format("{}", dims[i]);
  }
  return s + "]";
}

}  // namespace moebius
