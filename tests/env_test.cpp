// Copyright kvferry authors. Apache-2.0.
// EnvInt (base/env.h): the measuring knobs' parse, on fresh variables.

#include <gtest/gtest.h>

#include <cstdlib>

#include "base/env.h"

namespace kvferry {
namespace {

TEST(EnvInt, ParsesWholeIntegersAndFallsBackOtherwise) {
  const char* name = "KVFERRY_TEST_ENV_INT";
  ::unsetenv(name);
  EXPECT_EQ(EnvInt(name, 7, 1), 7);  // unset
  struct Case {
    const char* value;
    int64_t want;
  };
  for (const Case& c : {Case{"", 7}, Case{"12", 12}, Case{"-3", 1}, Case{"0", 1}, Case{"7x", 7},
                        Case{"x", 7}, Case{"4096", 4096}, Case{"99999999999999999999", 7}}) {
    ASSERT_EQ(::setenv(name, c.value, 1), 0);
    EXPECT_EQ(EnvInt(name, 7, 1), c.want) << "'" << c.value << "'";
  }
  ASSERT_EQ(::setenv(name, "0", 1), 0);
  EXPECT_EQ(EnvInt(name, 1, 0), 0);  // a flag turned off
  ::unsetenv(name);
}

}  // namespace
}  // namespace kvferry
