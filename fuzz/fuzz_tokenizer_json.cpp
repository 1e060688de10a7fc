// libFuzzer target: BpeTokenizer::from_json, the tokenizer.json loader (tokenizer/bpe_tokenizer.h),
// then encoding and decoding with whatever it accepts.
// Inputs above 64 KiB are skipped: the loader's cost is linear in its input, and the sizes that
// matter (ids, merge counts) fit in far fewer bytes. Beyond "no crash, no sanitizer report":
//   - a refusal is an Error whose message names the source;
//   - an accepted tokenizer is bounded by its file: at most one id per byte of input, at most one
//     merge per byte (so no id or count in the file can make the loader allocate more than that);
//   - fixed strings (ASCII, CJK, emoji, combining marks, invalid UTF-8), every added token inside
//     text, and a slice of the input itself encode to known ids with parse_special on and off;
//   - without added tokens, decode(encode(s)) gives s back, with invalid UTF-8 replaced and NFC
//     applied when the file asks for it;
//   - the StreamingDecoder's output over those ids and over arbitrary ids taken from the input
//     equals decode_text() of the same ids, and is valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/streaming_decoder.h"
#include "tokenizer/unicode.h"

using namespace moebius::tokenizer;
namespace unicode = moebius::unicode;

namespace {

using moebius::fuzz::check;

constexpr size_t kMaxInput = 64 * 1024;

void check_stream(const BpeTokenizer& tok, const std::vector<TokenId>& ids, DecodeOptions options) {
  StreamingDecoder stream(tok, options);
  std::string streamed;
  for (TokenId id : ids) streamed += stream.feed(id);
  streamed += stream.flush();
  check(streamed == tok.decode_text(ids, options));
  check(unicode::is_valid_utf8(streamed));
}

void check_text(const BpeTokenizer& tok, std::string_view text, bool nfc) {
  for (bool parse_special : {true, false}) {
    const std::vector<TokenId> ids = tok.encode(text, {.parse_special = parse_special});
    for (TokenId id : ids) check(tok.is_known(id) && tok.id_to_token(id).has_value());
    if (tok.added_tokens().empty()) {
      const std::string clean = unicode::sanitize_utf8(text);
      check(tok.decode(ids) == (nfc ? unicode::nfc(clean) : clean));
    }
    check_stream(tok, ids, {});
    check_stream(tok, ids, {.skip_special_tokens = true});
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto loaded = BpeTokenizer::from_json(text, "fuzz.json");
  if (!loaded.ok()) {
    const std::string what = loaded.error().what();
    check(!loaded.error().message().empty());
    check(what.find("fuzz.json") != std::string::npos);
    return 0;
  }
  const BpeTokenizer& tok = *loaded;
  check(tok.vocab_size() >= 256 && tok.vocab_size() <= size);
  check(tok.merge_count() <= size);
  check(tok.added_tokens().size() <= size);
  // The loader accepted it, so the normalizer is NFC or absent/null.
  const nlohmann::json root = nlohmann::json::parse(text);
  const bool nfc = root.contains("normalizer") && root["normalizer"].is_object();

  static const char* const kFixed[] = {
      "Hello, world! It's 2024 -- ok?",
      "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c\xe3\x80\x82",  // 你好，世界。
      "\xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd \xf0\x9f\x87\xab\xf0\x9f\x87\xb7!",       // 👋🏽 🇫🇷!
      "cafe\xcc\x81 caf\xc3\xa9 \xe1\x84\x80\xe1\x85\xa1",                        // decomposed, composed, jamo
      "\xff\xfe \xc3( \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 end",                 // invalid UTF-8
      "  \n\n\t x  \r\n   ",
      "",
  };
  for (const char* s : kFixed) check_text(tok, s, nfc);
  for (const AddedToken& a : tok.added_tokens()) {
    check_text(tok, a.content, nfc);
    check_text(tok, "x " + a.content + "  " + a.content + "y", nfc);
  }
  check_text(tok, text.substr(size > 256 ? size - 256 : 0), nfc);

  // Arbitrary ids (known, unknown, huge) from the input's last bytes.
  std::vector<TokenId> ids;
  for (size_t i = 0; i + 2 <= std::min<size_t>(size, 128); i += 2) {
    const TokenId id = (TokenId{data[size - 1 - i]} << 8 | data[size - 2 - i]) % (tok.vocab_size() + 8);
    ids.push_back(i % 16 == 0 ? ~TokenId{0} - id : id);
  }
  (void)tok.decode(ids);
  check_stream(tok, ids, {});
  check_stream(tok, ids, {.skip_special_tokens = true});
  for (TokenId id : ids) {
    check(tok.is_known(id) == tok.id_to_token(id).has_value());
    if (!tok.is_known(id)) check(tok.token_bytes(id).empty() && !tok.is_special(id));
  }
  return 0;
}
