// `moebius generate --chat` through the real binary: the prompt is the user's message rendered with
// the tokenizer directory's chat template (here the tiny fixture's ChatML), so the run equals one
// given the rendered text's ids; the chat flags' misuse is an error naming the flag.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "test_util.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius {
namespace {

using testing::CliRun;
CliRun run_moebius(const std::string& args) { return testing::run_shell(std::string(MOEBIUS_BIN) + " " + args); }

const std::string kModel = testing::test_data_dir() + "/tiny-qwen3-moe";
const std::string kTokenizer = testing::test_data_dir() + "/tiny-serve";

// The generated text: stdout's line before the report (which starts with "prompt tokens:").
std::string generated_text(const std::string& out) { return out.substr(0, out.find("prompt tokens:")); }

TEST(GenerateChatCli, RendersTheChatTemplateAroundThePrompt) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const std::string common = fmt::format("generate --model {} --tokenizer {} --max-tokens 5 --temperature 0 ", kModel,
                                         kTokenizer);
  const CliRun chat = run_moebius(common + "--chat --system 'be brief' --prompt hello");
  ASSERT_EQ(chat.status, 0) << chat.out;
  // The fixture's template is plain ChatML, written out here.
  auto tok = tokenizer::BpeTokenizer::load(kTokenizer + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.error().what();
  const auto ids = tok->encode(
      "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_NE(chat.out.find(fmt::format("prompt tokens:    {}\n", ids.size())), std::string::npos) << chat.out;
  std::string list;
  for (size_t i = 0; i < ids.size(); ++i) list += (i ? "," : "") + std::to_string(ids[i]);
  const CliRun by_ids = run_moebius(common + "--prompt-ids " + list);
  ASSERT_EQ(by_ids.status, 0) << by_ids.out;
  EXPECT_EQ(generated_text(chat.out), generated_text(by_ids.out));
  // Without --chat the same words are a different, shorter prompt.
  const CliRun plain = run_moebius(common + "--prompt hello");
  ASSERT_EQ(plain.status, 0) << plain.out;
  EXPECT_EQ(plain.out.find(fmt::format("prompt tokens:    {}\n", ids.size())), std::string::npos) << plain.out;
}

TEST(GenerateChatCli, MisusedFlagsNameTheFlag) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const auto expect_error = [](const std::string& args, const std::string& needle) {
    const CliRun r = run_moebius("generate --model " + kModel + " " + args);
    EXPECT_NE(r.status, 0) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
  };
  expect_error("--tokenizer " + kTokenizer + " --chat --prompt-ids 1,2", "'--chat'");
  expect_error("--tokenizer " + kTokenizer + " --system hi --prompt hello", "'--system'");
  expect_error("--tokenizer " + kTokenizer + " --no-thinking --prompt hello", "'--no-thinking'");
  expect_error("--tokenizer /nonexistent-moebius-dir --prompt hello", "'--tokenizer'");
  // A tokenizer directory without tokenizer_config.json: no template to render.
  const std::filesystem::path bare = std::filesystem::temp_directory_path() / "moebius-generate-chat-bare";
  std::filesystem::create_directories(bare);
  std::filesystem::copy_file(kTokenizer + "/tokenizer.json", bare / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  expect_error("--tokenizer " + bare.string() + " --chat --prompt hello", "'--chat'");
  std::filesystem::remove_all(bare);
}

}  // namespace
}  // namespace moebius
