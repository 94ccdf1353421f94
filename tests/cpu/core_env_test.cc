#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>

namespace shardline::env {
namespace {

using ::testing::HasSubstr;

/// Sets a variable for one test and restores the absence of it afterwards, even when an assertion fails.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
    ~ScopedEnv() { ::unsetenv(name_); }

private:
    const char* name_;
};

std::string MessageOf(void (*f)()) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "(no error)";
}

TEST(EnvTest, BoolAcceptsEveryDocumentedSpellingCaseInsensitively) {
    for (const char* yes : {"1", "true", "on", "yes", "TRUE", "On", "Yes"}) {
        EXPECT_TRUE(ParseBool("SHARDLINE_X", yes)) << yes;
    }
    for (const char* no : {"0", "false", "off", "no", "FALSE", "Off", "NO"}) {
        EXPECT_FALSE(ParseBool("SHARDLINE_X", no)) << no;
    }
}

TEST(EnvTest, BoolTypoIsAnErrorNamingTheVariableAndTheAcceptedValues) {
    // The old SHARDLINE_COMM_CHECK parser read "yes" as off and SHARDLINE_ALLOW_TF32 read "ture" as off.
    const std::string message = MessageOf([] { ParseBool("SHARDLINE_ALLOW_TF32", "ture"); });
    EXPECT_THAT(message, HasSubstr("SHARDLINE_ALLOW_TF32"));
    EXPECT_THAT(message, HasSubstr("1/0, true/false, on/off, yes/no"));
    EXPECT_THAT(message, HasSubstr("'ture'"));
}

TEST(EnvTest, IntParsesWithinRangeAndRejectsTrailingTextAndOutOfRange) {
    EXPECT_EQ(ParseInt("SHARDLINE_N", "32", 0, 64), 32);
    EXPECT_EQ(ParseInt("SHARDLINE_N", "-3", -5, 5), -3);
    EXPECT_THAT(MessageOf([] { ParseInt("SHARDLINE_N", "65", 1, 64); }),
                HasSubstr("expected an integer in 1..64, got '65'"));
    EXPECT_THAT(MessageOf([] { ParseInt("SHARDLINE_N", "8MB", 1, 64); }), HasSubstr("got '8MB'"));
    EXPECT_THAT(MessageOf([] { ParseInt("SHARDLINE_N", "", 1, 64); }), HasSubstr("SHARDLINE_N"));
}

TEST(EnvTest, DoubleParsesScientificAndRejectsNonFiniteAndOutOfRange) {
    EXPECT_DOUBLE_EQ(ParseDouble("SHARDLINE_T", "0.5", 1e-3, 10), 0.5);
    EXPECT_DOUBLE_EQ(ParseDouble("SHARDLINE_T", "1e2", 1e-3, 1e3), 100.0);
    EXPECT_THAT(MessageOf([] { ParseDouble("SHARDLINE_T", "0", 1e-3, 10); }), HasSubstr("got '0'"));
    EXPECT_THAT(MessageOf([] { ParseDouble("SHARDLINE_T", "inf", 1e-3, 1e300); }), HasSubstr("got 'inf'"));
    EXPECT_THAT(MessageOf([] { ParseDouble("SHARDLINE_T", "2s", 1e-3, 10); }), HasSubstr("got '2s'"));
}

TEST(EnvTest, ChoiceListsTheAcceptedWords) {
    EXPECT_EQ(ParseChoice("SHARDLINE_BACKEND", "cpu", {"auto", "cpu", "cuda"}), "cpu");
    EXPECT_THAT(MessageOf([] { ParseChoice("SHARDLINE_BACKEND", "gpu", {"auto", "cpu", "cuda"}); }),
                HasSubstr("SHARDLINE_BACKEND: expected one of auto, cpu, cuda, got 'gpu'"));
}

TEST(EnvTest, UnsetOrEmptyGivesTheFallback) {
    ::unsetenv("SHARDLINE_ENV_TEST_VAR");
    EXPECT_FALSE(Get("SHARDLINE_ENV_TEST_VAR").has_value());
    EXPECT_TRUE(GetBool("SHARDLINE_ENV_TEST_VAR", true));
    EXPECT_EQ(GetInt("SHARDLINE_ENV_TEST_VAR", 7, 0, 10), 7);
    const ScopedEnv empty("SHARDLINE_ENV_TEST_VAR", "");
    EXPECT_FALSE(Get("SHARDLINE_ENV_TEST_VAR").has_value());
    EXPECT_DOUBLE_EQ(GetDouble("SHARDLINE_ENV_TEST_VAR", 2.5, 0, 10), 2.5);
    EXPECT_EQ(GetChoice("SHARDLINE_ENV_TEST_VAR", "auto", {"auto", "cpu"}), "auto");
}

TEST(EnvTest, SetValueIsParsedWithTheSameGrammar) {
    const ScopedEnv set("SHARDLINE_ENV_TEST_VAR", "off");
    EXPECT_EQ(Get("SHARDLINE_ENV_TEST_VAR").value_or(""), "off");
    EXPECT_FALSE(GetBool("SHARDLINE_ENV_TEST_VAR", true));
    EXPECT_THROW(GetInt("SHARDLINE_ENV_TEST_VAR", 1, 0, 10), Error);
}

} // namespace
} // namespace shardline::env
