// The README job's progress line: StepWindow (examples/char_lm.h) counts the steps it timed, driven exactly as
// train_char_lm's loop drives it (a line at step 1, every log_interval steps and at the last step; an evaluation every
// eval_interval steps, untimed). With every step taking 1 ms of a fake clock and every evaluation 50 ms, each line
// must say 1 ms/step; the old count (the log interval) said 0.9 at step 10 and 0.5 after an evaluation.

#include <chrono>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "char_lm.h"

namespace {

using char_lm::StepWindow;
using std::chrono::milliseconds;

struct Line {
    std::int64_t step;
    double ms_per_step;
};

std::vector<Line> Drive(std::int64_t steps, std::int64_t log_interval, std::int64_t eval_interval) {
    StepWindow::Clock::time_point now{};
    StepWindow window;
    window.Open(1, now);
    std::vector<Line> lines;
    for (std::int64_t step = 1; step <= steps; ++step) {
        now += milliseconds(1); // the step
        const bool log = step % log_interval == 0 || step == steps || step == 1;
        const bool eval = step % eval_interval == 0 || step == steps;
        if (!log && !eval) {
            continue;
        }
        lines.push_back({step, window.MsPerStep(step, now)});
        if (eval) {
            now += milliseconds(50); // the evaluation
        }
        window.Open(step + 1, now);
    }
    return lines;
}

TEST(StepWindowTest, EveryLineCountsTheStepsItTimedAfterStepOneAndAfterAnEvaluation) {
    // The README GPU config: 50 steps, a line every 10, an evaluation every 25.
    const std::vector<Line> lines = Drive(50, 10, 25);
    std::vector<std::int64_t> steps;
    for (const Line &l : lines) {
        steps.push_back(l.step);
        EXPECT_DOUBLE_EQ(l.ms_per_step, 1.0) << "step " << l.step;
    }
    EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 10, 20, 25, 30, 40, 50}));
}

TEST(StepWindowTest, WindowsOfOddLengthsAreCounted) {
    StepWindow window;
    const StepWindow::Clock::time_point t0{};
    window.Open(8, t0);
    EXPECT_EQ(window.Steps(10), 3);
    EXPECT_DOUBLE_EQ(window.MsPerStep(10, t0 + milliseconds(6)), 2.0);
    for (const Line &l : Drive(7, 3, 5)) {
        EXPECT_DOUBLE_EQ(l.ms_per_step, 1.0) << "step " << l.step;
    }
}

TEST(StepWindowTest, HostTimeIsPerTimedStepAndStartsOverWithEachWindow) {
    StepWindow window;
    const StepWindow::Clock::time_point t0{};
    window.Open(11, t0);
    for (int i = 0; i < 10; ++i) {
        window.AddHostTime(milliseconds(3));
    }
    EXPECT_DOUBLE_EQ(window.HostMsPerStep(20), 3.0);
    window.Open(21, t0 + milliseconds(100)); // after the line at step 20 (and, say, an evaluation)
    window.AddHostTime(milliseconds(7));
    window.AddHostTime(milliseconds(5));
    EXPECT_DOUBLE_EQ(window.HostMsPerStep(22), 6.0);
}

} // namespace
