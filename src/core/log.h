// Leveled logging to stderr. The level comes from MOEBIUS_LOG (error|warn|info|debug), default
// info. Logging is for people; machine-readable output goes to stdout from the CLI only.
#pragma once

#include <string_view>

#include <fmt/format.h>

namespace moebius {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_write(LogLevel level, std::string_view message);

template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log_write(LogLevel::kError, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kWarn) log_write(LogLevel::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kInfo) log_write(LogLevel::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kDebug) log_write(LogLevel::kDebug, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace moebius
