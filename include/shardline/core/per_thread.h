#pragma once

// One object per thread for hot paths (the dispatcher's resolution cache, the autograd engine's scratch) that must also
// work when called from a destructor that runs as the thread or the process ends.

namespace shardline::detail {

/// This thread's T, value-initialized on first use and destroyed at thread exit. Once this thread has used it and its
/// thread-locals are being destroyed, it is null, so that a caller running from another thread-local's or a static's
/// destructor gets null (and takes a path of its own) rather than a destroyed object. (A first use from such a
/// destructor makes a T that is never freed: a leak at exit, not a crash.) The pointer and its flag are trivially
/// destructible and so stay readable until the thread ends; only the object has an owner. Each (T, Tag) pair has its
/// own object: a caller passes a Tag private to it (its own class), so that two users of the same T never share one.
template <class T, class Tag> T* PerThread() {
    static thread_local T* instance = nullptr;
    static thread_local bool gone = false;
    if (instance == nullptr && !gone) {
        struct Owner {
            Owner() = default;
            Owner(const Owner&) = delete;
            Owner& operator=(const Owner&) = delete;
            ~Owner() {
                // Gone before T's destructor runs: whatever that reaches sees null, not the object being destroyed.
                T* last = instance;
                instance = nullptr;
                gone = true;
                delete last;
            }
        };
        thread_local Owner owner; // constructed on this first use, destroyed at thread exit
        instance = new T();
    }
    return instance;
}

} // namespace shardline::detail
