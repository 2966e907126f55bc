// Copyright kvferry authors. Apache-2.0.
// The llama tools' progress lines: durations, the rate and ETA, the cadence off a terminal and the
// live line on one, with a fake clock.
#include <algorithm>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "tools/common/progress.h"

namespace kvferry::tools {
namespace {

std::string Captured(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  for (int c; (c = std::fgetc(f)) != EOF;) s.push_back(static_cast<char>(c));
  return s;
}

TEST(LlamaProgress, FormatsDurations) {
  EXPECT_EQ(FormatDuration(0), "0:00");
  EXPECT_EQ(FormatDuration(9.4), "0:09");
  EXPECT_EQ(FormatDuration(247), "4:07");
  EXPECT_EQ(FormatDuration(3903), "1:05:03");
  EXPECT_EQ(FormatDuration(-1), "?");
  EXPECT_EQ(FormatDuration(1.0 / 0.0), "?");
}

TEST(LlamaProgress, OffATerminalALineEveryFewSecondsWithRateAndEta) {
  std::FILE* f = std::tmpfile();
  double now = 100.0;
  {
    Progress p("prefill", 1000, "tokens", f, /*tty=*/0, [&] { return now; }, 5.0);
    now = 101.0;
    p.Update(100);  // 1 s in: too soon
    now = 105.5;
    p.Update(500);  // 5.5 s in: 500 tokens, 90.9/s, 500 left -> ETA 5.5 s
    now = 106.0;
    p.Update(550);  // 0.5 s after the last line: nothing
    now = 111.0;
    p.Update(1000);  // done: always printed
  }
  const std::string out = Captured(f);
  std::fclose(f);
  EXPECT_EQ(out,
            "prefill: 500/1000 tokens (50%), 90.9 tokens/s, ETA 0:06\n"
            "prefill: 1000/1000 tokens (100%), 90.9 tokens/s, took 0:11\n");
}

TEST(LlamaProgress, OnATerminalOneLiveLineEndedOnce) {
  std::FILE* f = std::tmpfile();
  double now = 0.0;
  {
    Progress p("perplexity", 4, "tokens", f, /*tty=*/1, [&] { return now; });
    for (int i = 1; i <= 4; ++i) {
      now += 1.0;
      p.Update(i);
    }
    p.Finish();
  }
  const std::string out = Captured(f);
  std::fclose(f);
  EXPECT_EQ(out.front(), '\r');
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 4);
  EXPECT_NE(out.find("4/4 tokens (100%), 1.0 tokens/s, took 0:04"), std::string::npos);
}

TEST(LlamaProgress, ShortLoopsAreSilent) {
  std::FILE* f = std::tmpfile();
  double now = 0.0;
  {
    Progress p("prefill", 512, "tokens", f, 0, [&] { return now; }, 5.0, /*min_total=*/513);
    now = 100.0;
    p.Update(512);
  }
  EXPECT_EQ(Captured(f), "");
  std::fclose(f);
}

}  // namespace
}  // namespace kvferry::tools
