// StopMatcher: stop strings over text that arrives in pieces (server/stop_strings.h).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/stop_strings.h"

namespace moebius::server {
namespace {

// Feeds `pieces` one by one; returns everything emitted and whether it stopped.
std::pair<std::string, bool> run(const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
  StopMatcher m(stops);
  std::string out;
  for (const std::string& p : pieces) {
    StopMatcher::Out o = m.feed(p);
    out += o.text;
    if (o.stopped) return {out, true};
  }
  return {out + m.flush(), false};
}

TEST(StopStrings, NoStopsPassesEverythingAtOnce) {
  StopMatcher m(std::vector<std::string>{});
  EXPECT_EQ(m.feed("hello").text, "hello");
  EXPECT_EQ(m.held_bytes(), 0u);
}

TEST(StopStrings, StopInsideOnePiece) {
  EXPECT_EQ(run({"END"}, {"abcENDdef"}), std::make_pair(std::string("abc"), true));
}

TEST(StopStrings, StopSplitAcrossPieces) {
  EXPECT_EQ(run({"<|end|>"}, {"ab<", "|en", "d|", ">tail"}), std::make_pair(std::string("ab"), true));
  EXPECT_EQ(run({"xyz"}, {"x", "y", "z"}), std::make_pair(std::string(""), true));
}

TEST(StopStrings, HoldsBackOnlyWhatCouldStartAStop) {
  StopMatcher m({"STOP"});
  StopMatcher::Out o = m.feed("abcST");
  EXPECT_EQ(o.text, "abc");
  EXPECT_EQ(m.held_bytes(), 2u);
  o = m.feed("x");  // "STx" can no longer become STOP: released
  EXPECT_EQ(o.text, "STx");
  EXPECT_FALSE(o.stopped);
  EXPECT_EQ(m.held_bytes(), 0u);
}

TEST(StopStrings, FalseStartThenRealStop) {
  // "aab": the first 'a' cannot start "ab" once the second 'a' arrives, the second can.
  EXPECT_EQ(run({"ab"}, {"a", "a", "b"}), std::make_pair(std::string("a"), true));
  EXPECT_EQ(run({"abab"}, {"aba", "bab"}), std::make_pair(std::string(""), true));
}

// Of overlapping stop strings, the one that completes first wins, however the text is cut.
TEST(StopStrings, TheFirstToCompleteWins) {
  EXPECT_EQ(run({"world", "lo w"}, {"hello world"}), std::make_pair(std::string("hel"), true));
  for (const auto& pieces : std::vector<std::vector<std::string>>{{"xabc"}, {"x", "a", "b", "c"}, {"xa", "bc"}}) {
    EXPECT_EQ(run({"b", "abc"}, pieces), std::make_pair(std::string("xa"), true));  // "b" ends first
    EXPECT_EQ(run({"abc", "b"}, pieces), std::make_pair(std::string("xa"), true));  // whatever the list order
  }
  EXPECT_EQ(run({"bc", "abc"}, {"xabcd"}), std::make_pair(std::string("x"), true));  // same end: earlier start
}

TEST(StopStrings, FlushReleasesPartialMatchAtTheEnd) {
  EXPECT_EQ(run({"STOP"}, {"abc", "STO"}), std::make_pair(std::string("abcSTO"), false));
}

TEST(StopStrings, NothingAfterStop) {
  StopMatcher m({"."});
  EXPECT_TRUE(m.feed("a.b").stopped);
  EXPECT_EQ(m.feed("more").text, "");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStrings, Utf8StaysWhole) {
  // The stop string shares a lead byte with other characters: "é" is C3 A9, "ä" is C3 A4.
  auto [text, stopped] = run({"é!"}, {"caf", "\xC3\xA4", "\xC3\xA9", "!"});
  EXPECT_EQ(text, "caf\xC3\xA4");
  EXPECT_TRUE(stopped);
  StopMatcher m({"é!"});
  EXPECT_EQ(m.feed("\xC3\xA9").text, "");  // held: could become "é!"
  EXPECT_EQ(m.feed("x").text, "\xC3\xA9x");
}

TEST(StopStrings, EmptyStopStringsAreIgnored) {
  EXPECT_EQ(run({"", "z"}, {"abc"}), std::make_pair(std::string("abc"), false));
}

// min_tokens (vLLM's rule): a stop string wholly inside the unchecked text is not a stop; one that
// begins there and completes in checked text is, and the text before it is all that is emitted.
TEST(StopStrings, UncheckedTextCannotStopButCanBeginAStop) {
  {
    StopMatcher m({"ab"});
    EXPECT_EQ(m.feed_unchecked("xab").text, "xab");  // wholly unchecked: released, no stop
    EXPECT_FALSE(m.stopped());
    StopMatcher::Out o = m.feed("cab");
    EXPECT_EQ(o.text, "c");
    EXPECT_TRUE(o.stopped);
  }
  {
    StopMatcher m({"<|end|>"});
    EXPECT_EQ(m.feed_unchecked("hi <|e").text, "hi ");  // could begin the stop: held
    StopMatcher::Out o = m.feed("nd|> more");           // completes after the boundary
    EXPECT_EQ(o.text, "");
    EXPECT_TRUE(o.stopped);
  }
  {
    // "b" lies wholly inside held unchecked text (held as a prefix of "abc"): not a stop, even when
    // a checked piece arrives while it is still held; "abc" completing later is.
    StopMatcher m({"abc", "b"});
    EXPECT_EQ(m.feed_unchecked("xab").text, "x");
    StopMatcher::Out o = m.feed("");
    EXPECT_FALSE(o.stopped);
    o = m.feed("c");
    EXPECT_EQ(o.text, "");
    EXPECT_TRUE(o.stopped);
  }
  {
    StopMatcher m({"abc", "b"});
    EXPECT_EQ(m.feed_unchecked("xab").text, "x");
    StopMatcher::Out o = m.feed("b");  // "abb": the checked "b" stops; the unchecked one did not
    EXPECT_EQ(o.text, "ab");
    EXPECT_TRUE(o.stopped);
  }
  {
    StopMatcher m({"STOP"});
    EXPECT_EQ(m.feed_unchecked("aSTO").text, "a");
    EXPECT_EQ(m.flush(), "STO");  // the end without a stop: the held tail is released
  }
}

// include_stop (vLLM's include_stop_str_in_output): the text ends with the stop string; of two
// starting at one place, the shorter (it completed first).
TEST(StopStrings, IncludeStopKeepsTheStopString) {
  const auto run_incl = [](const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
    StopMatcher m(stops, true);
    std::string out;
    for (const std::string& p : pieces) {
      StopMatcher::Out o = m.feed(p);
      out += o.text;
      if (o.stopped) return std::make_pair(out, true);
    }
    return std::make_pair(out + m.flush(), false);
  };
  EXPECT_EQ(run_incl({"END"}, {"abcENDdef"}), std::make_pair(std::string("abcEND"), true));
  EXPECT_EQ(run_incl({"<|end|>"}, {"ab<", "|en", "d|", ">tail"}), std::make_pair(std::string("ab<|end|>"), true));
  EXPECT_EQ(run_incl({"abc", "ab"}, {"xabcd"}), std::make_pair(std::string("xab"), true));
  for (const auto& pieces : std::vector<std::vector<std::string>>{{"abcd"}, {"a", "b", "c", "d"}})
    EXPECT_EQ(run_incl({"bc", "abcd"}, pieces), std::make_pair(std::string("abc"), true));
  EXPECT_EQ(run_incl({"STOP"}, {"abc", "STO"}), std::make_pair(std::string("abcSTO"), false));
  StopMatcher m({"ab"}, true);
  EXPECT_EQ(m.feed_unchecked("xa").text, "x");
  StopMatcher::Out o = m.feed("b!");
  EXPECT_EQ(o.text, "ab");
  EXPECT_TRUE(o.stopped);
}

// feed_unchecked followed by feed emits the same bytes as one feed when no stop is involved, for
// every split point.
TEST(StopStrings, UncheckedSplitsLoseNothing) {
  const std::string text = "a<b<|en<|end abab STO";
  for (size_t cut = 0; cut <= text.size(); ++cut)
    for (size_t cut2 = cut; cut2 <= text.size(); ++cut2) {
      StopMatcher m({"<|end|>", "STOP", "abc"});
      std::string out = m.feed_unchecked(text.substr(0, cut)).text;
      out += m.feed_unchecked(text.substr(cut, cut2 - cut)).text;
      StopMatcher::Out o = m.feed(text.substr(cut2));
      out += o.text;
      ASSERT_FALSE(o.stopped);
      out += m.flush();
      EXPECT_EQ(out, text) << cut << " " << cut2;
    }
}

}  // namespace
}  // namespace moebius::server
