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

TEST(StopStrings, EarliestOfSeveralWins) {
  EXPECT_EQ(run({"world", "lo w"}, {"hello world"}), std::make_pair(std::string("hel"), true));
  EXPECT_EQ(run({"b", "abc"}, {"xabc"}), std::make_pair(std::string("x"), true));  // "abc" starts first
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

}  // namespace
}  // namespace moebius::server
