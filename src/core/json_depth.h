// How deeply JSON text nests, measured on the text before a parser builds anything from it.
//
// nlohmann's parser itself is iterative, but much of what follows a parse recurses once per level:
// copying a value (json::value() copies), dump() (every error that quotes a value), and growing an
// ordered_json object, whose pairs have a const key and so are copied, not moved, when its vector
// reallocates. A file nested tens of thousands of levels deep overflows the stack in one of those.
// Every parser of JSON files checks the depth first [TAG_JSON_DEPTH]; real config.json,
// generation_config.json, quantization configs, tokenizer.json and tokenizer_config.json files,
// routing profiles and the tuning cache nest fewer than 10 levels.
// (safetensors.cpp has its own stricter precheck; the server bounds request bodies with
// ApiLimits::max_json_depth.)
#pragma once

#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace moebius {

inline constexpr int64_t kMaxJsonFileDepth = 64;

struct JsonShape {
  int64_t depth = 0;   // the deepest nesting of arrays and objects
  int64_t values = 0;  // an upper bound of the values a parse builds ([TAG_JSON_VALUES], below)
};

// One pass over `text` outside its strings (brackets and commas inside strings do not count). Not
// a validator: malformed text gets some numbers, and the parser refuses it afterwards.
// values: one per '[' or '{' and one per ',', plus one; every scalar, string, array and object
// counts (object keys do not), an empty array or object one more than it is.
inline JsonShape json_shape(std::string_view text) {
  JsonShape shape;
  shape.values = text.empty() ? 0 : 1;
  int64_t depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      ++shape.values;
      if (++depth > shape.depth) shape.depth = depth;
    } else if (c == ']' || c == '}') {
      --depth;
    } else if (c == ',') {
      ++shape.values;
    }
  }
  return shape;
}

// The deepest nesting of arrays and objects in `text`.
inline int64_t json_nesting_depth(std::string_view text) { return json_shape(text).depth; }

// [TAG_JSON_VALUES] How many values a parse of `text` would build, at most. A parsed document costs
// ~16 bytes per value and up to ~100 per string, array or object (their heap parts), so a 4 MiB
// request body of "[[],[],...]" became ~100 MB of DOM; the server refuses bodies past
// ApiLimits::max_json_values before it parses them.
inline int64_t json_value_bound(std::string_view text) { return json_shape(text).values; }

// An Error when `text` nests deeper than `max_depth`; the caller adds the file.
inline Status check_json_depth(std::string_view text, int64_t max_depth = kMaxJsonFileDepth) {
  if (json_nesting_depth(text) > max_depth) return Error::format("JSON nests deeper than {} levels", max_depth);
  return Ok{};
}

}  // namespace moebius
