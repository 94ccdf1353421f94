// detail::PerThread (include/shardline/core/per_thread.h), the per-thread object behind the dispatcher's resolution
// cache and the autograd engine's scratch: one object per thread and Tag, created on first use, destroyed at thread
// exit; and, from a thread-local destructor that runs after its owner's (or from the object's own destructor), null
// instead of a destroyed object.

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/core/per_thread.h>

namespace shardline::detail {
namespace {

std::atomic<int> g_alive{0};

/// Counts live objects; `value` marks one object (another thread's starts at 0).
struct Counted {
    Counted() { ++g_alive; }
    ~Counted() { --g_alive; }
    Counted(const Counted &) = delete;
    Counted &operator=(const Counted &) = delete;
    int value = 0;
};

struct TagA {};
struct TagB {};

TEST(PerThreadTest, OneObjectPerThreadAndTagCreatedOnFirstUseAndDestroyedAtThreadExit) {
    const int before = g_alive.load();
    std::thread worker([&] {
        Counted *a = PerThread<Counted, TagA>();
        ASSERT_NE(a, nullptr);
        EXPECT_EQ(g_alive.load(), before + 1);
        EXPECT_EQ((PerThread<Counted, TagA>()), a) << "the same object on every call";
        Counted *b = PerThread<Counted, TagB>();
        ASSERT_NE(b, nullptr);
        EXPECT_NE(b, a) << "another Tag, another object";
        EXPECT_EQ(g_alive.load(), before + 2);
        a->value = 7;
        std::thread inner([&] {
            Counted *mine = PerThread<Counted, TagA>();
            ASSERT_NE(mine, nullptr);
            EXPECT_NE(mine, a) << "another thread, another object";
            EXPECT_EQ(mine->value, 0);
        });
        inner.join();
        EXPECT_EQ(g_alive.load(), before + 2) << "the inner thread's object went with it";
        EXPECT_EQ((PerThread<Counted, TagA>()->value), 7);
    });
    worker.join();
    EXPECT_EQ(g_alive.load(), before) << "both objects destroyed at the worker's exit";
}

/// A thread-local whose destructor asks for the per-thread object, as a dispatch or a backward from a destructor does.
struct AsksInItsDestructor {
    Counted **seen;
    ~AsksInItsDestructor() { *seen = PerThread<Counted, AsksInItsDestructor>(); }
};

TEST(PerThreadTest, ADestructorRunningAfterTheOwnersGetsNull) {
    // Thread-locals are destroyed in the reverse order of their construction. `early` is constructed before the
    // object's owner, so it is destroyed after it: it must see null. `late` is constructed after, so it is destroyed
    // before the owner and still sees the object.
    Counted *seen_early = reinterpret_cast<Counted *>(1);
    Counted *seen_late = nullptr;
    Counted *made = nullptr;
    const int before = g_alive.load();
    std::thread worker([&] {
        thread_local AsksInItsDestructor early{&seen_early};
        made = PerThread<Counted, AsksInItsDestructor>();
        thread_local AsksInItsDestructor late{&seen_late};
        (void)early;
        (void)late;
    });
    worker.join();
    EXPECT_NE(made, nullptr);
    EXPECT_EQ(seen_late, made) << "destroyed before the owner: the object is still there";
    EXPECT_EQ(seen_early, nullptr) << "destroyed after the owner: null, not the destroyed object";
    EXPECT_EQ(g_alive.load(), before) << "and nothing was made again after the owner had gone";
}

/// A T whose own destructor asks for the per-thread object again (as a pooled scratch's cleanup could).
struct AsksForItself {
    static inline std::atomic<bool> destroyed{false};
    static inline std::atomic<AsksForItself *> seen{nullptr};
    ~AsksForItself() {
        seen = PerThread<AsksForItself, AsksForItself>();
        destroyed = true;
    }
};

TEST(PerThreadTest, TheObjectsOwnDestructorGetsNullNotTheObjectBeingDestroyed) {
    AsksForItself::destroyed = false;
    AsksForItself::seen = reinterpret_cast<AsksForItself *>(1);
    std::thread worker([] { ASSERT_NE((PerThread<AsksForItself, AsksForItself>()), nullptr); });
    worker.join();
    EXPECT_TRUE(AsksForItself::destroyed.load()) << "destroyed at the thread's exit";
    EXPECT_EQ(AsksForItself::seen.load(), nullptr);
}

} // namespace
} // namespace shardline::detail
