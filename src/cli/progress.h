// A loading progress bar on stderr: redrawn in place ("\r") on a terminal, else a plain line at
// every tenth of the way, so logs stay readable.
#pragma once

#include <string>

namespace moebius::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  void update(int done, int total);

 private:
  std::string label_;
  bool tty_ = false;
  int last_tenth_ = -1;
};

}  // namespace moebius::cli
