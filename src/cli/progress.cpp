#include "cli/progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace moebius::cli {

ProgressBar::ProgressBar(std::string label) : label_(std::move(label)), tty_(::isatty(STDERR_FILENO) == 1) {}

void ProgressBar::update(int done, int total) {
  if (total <= 0) return;
  if (tty_) {
    constexpr int kWidth = 40;
    const int fill = static_cast<int>(static_cast<int64_t>(kWidth) * done / total);
    std::fprintf(stderr, "\r%s [%s%s] %d/%d", label_.c_str(), std::string(static_cast<size_t>(fill), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - fill), '.').c_str(), done, total);
    if (done >= total) std::fputc('\n', stderr);
    std::fflush(stderr);
    return;
  }
  const int tenth = static_cast<int>(static_cast<int64_t>(10) * done / total);
  if (tenth == last_tenth_) return;
  last_tenth_ = tenth;
  std::fprintf(stderr, "%s: %d/%d (%d%%)\n", label_.c_str(), done, total, tenth * 10);
}

}  // namespace moebius::cli
