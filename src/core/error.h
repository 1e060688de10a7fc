// Error values for everything a user can get wrong: a malformed checkpoint, a bad flag, a bad
// request. Each error carries a message plus the context it happened in (file, tensor, field), so
// the user sees e.g.
//   file 'model-00001.safetensors': tensor 'model.layers.0.mlp.experts.3.down_proj.weight':
//   field 'data_offsets': end 4096 is past the end of the data section (2048 bytes)
// Asserts (MOEBIUS_ASSERT) are for our own bugs, never for user input.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace moebius {

class Error {
 public:
  Error() = default;
  explicit Error(std::string message) : message_(std::move(message)) {}

  template <typename... Args>
  static Error format(fmt::format_string<Args...> f, Args&&... args) {
    return Error(fmt::format(f, std::forward<Args>(args)...));
  }

  // Context setters return *this so call sites read naturally:
  //   return Error("offset out of range").in_file(path).in_tensor(name).in_field("data_offsets");
  // An outer context never overwrites an inner one that is already set.
  Error& in_file(std::string file) & { if (file_.empty()) file_ = std::move(file); return *this; }
  Error& in_tensor(std::string tensor) & { if (tensor_.empty()) tensor_ = std::move(tensor); return *this; }
  Error& in_field(std::string field) & { if (field_.empty()) field_ = std::move(field); return *this; }
  Error&& in_file(std::string file) && { return std::move(in_file(std::move(file))); }
  Error&& in_tensor(std::string tensor) && { return std::move(in_tensor(std::move(tensor))); }
  Error&& in_field(std::string field) && { return std::move(in_field(std::move(field))); }
  // Free-form context, outermost first in the final text ("loading layer 3: ...").
  Error& with_context(const std::string& what) & { message_ = what + ": " + message_; return *this; }
  Error&& with_context(const std::string& what) && { return std::move(with_context(what)); }

  const std::string& message() const { return message_; }
  const std::string& file() const { return file_; }
  const std::string& tensor() const { return tensor_; }
  const std::string& field() const { return field_; }

  // The full text shown to users.
  std::string what() const;

 private:
  std::string message_;
  std::string file_;
  std::string tensor_;
  std::string field_;
};

// Result<T>: a value or an Error. C++20 has no std::expected, so this is the small subset we use.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}          // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}      // NOLINT(google-explicit-constructor)

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & { check_ok(); return std::get<0>(v_); }
  const T& value() const& { check_ok(); return std::get<0>(v_); }
  T&& value() && { check_ok(); return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  const Error& error() const& { return std::get<1>(v_); }
  Error& error() & { return std::get<1>(v_); }
  Error&& error() && { return std::get<1>(std::move(v_)); }

 private:
  void check_ok() const {
    if (!ok()) {
      std::fprintf(stderr, "moebius: value() of a failed Result: %s\n", std::get<1>(v_).what().c_str());
      std::abort();
    }
  }
  std::variant<T, Error> v_;
};

struct Ok {};

// Status: success or an Error.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Ok) {}                                      // NOLINT(google-explicit-constructor)
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const& { return error_; }
  Error& error() & { return error_; }
  Error&& error() && { return std::move(error_); }

 private:
  Error error_;
  bool ok_ = true;
};
using Status = Result<void>;

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace moebius

// Propagate an error: MOEBIUS_TRY(status_expr);
#define MOEBIUS_TRY(expr)                                   \
  do {                                                      \
    auto&& moebius_try_r_ = (expr);                         \
    if (!moebius_try_r_.ok()) return std::move(moebius_try_r_).error(); \
  } while (0)

#define MOEBIUS_CONCAT_INNER_(a, b) a##b
#define MOEBIUS_CONCAT_(a, b) MOEBIUS_CONCAT_INNER_(a, b)
// Unwrap a value or propagate: MOEBIUS_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
#define MOEBIUS_ASSIGN_OR_RETURN(lhs, expr)                                      \
  auto MOEBIUS_CONCAT_(moebius_r_, __LINE__) = (expr);                           \
  if (!MOEBIUS_CONCAT_(moebius_r_, __LINE__).ok())                               \
    return std::move(MOEBIUS_CONCAT_(moebius_r_, __LINE__)).error();             \
  lhs = std::move(MOEBIUS_CONCAT_(moebius_r_, __LINE__)).value()

// For our own invariants only; never for user input.
#define MOEBIUS_ASSERT(cond, ...)                                                         \
  do {                                                                                    \
    if (!(cond)) ::moebius::assert_fail(#cond, __FILE__, __LINE__, ::fmt::format("" __VA_ARGS__)); \
  } while (0)
