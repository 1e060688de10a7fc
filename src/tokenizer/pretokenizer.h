// The Qwen2/Qwen3 pre-tokenizer: a hand-written matcher for the one Split regex these models use.
//
// std::regex has no \p{L}/\p{N} and is far too slow, and a general regex engine would be a large
// dependency for a single fixed pattern. The pattern is short enough to match by hand with the
// exact semantics of a backtracking engine (Oniguruma in HF tokenizers): alternatives tried in
// order at each position, the first that matches wins, quantifiers greedy with backtracking.
// pretokenizer.cpp spells out what each alternative reduces to.
#pragma once

#include <string_view>
#include <vector>

namespace moebius::tokenizer {

// The Split pattern of Qwen2, Qwen2.5 and Qwen3 tokenizer.json files, character for character
// (after JSON unescaping). A tokenizer.json whose pattern differs is refused, never approximated.
inline constexpr std::string_view kQwen2SplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Appends to `pieces` the consecutive matches of kQwen2SplitPattern over `text`, which must be
// valid UTF-8 (the tokenizer sanitizes its input first). Every character matches some
// alternative, so the pieces tile the text: concatenated, they give it back ("Isolated" split
// behavior with no gaps). The views point into `text`.
void split_qwen2(std::string_view text, std::vector<std::string_view>& pieces);

inline std::vector<std::string_view> split_qwen2(std::string_view text) {
  std::vector<std::string_view> pieces;
  split_qwen2(text, pieces);
  return pieces;
}

}  // namespace moebius::tokenizer
