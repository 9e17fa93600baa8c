// Threads joined however the scope that started them is left. A std::thread destroyed while still joinable calls
// std::terminate ("terminate called without an active exception"), so an exception thrown between starting a pool's
// threads and joining them (a failed thread start, an error on the calling thread) would abort the whole process.
#pragma once

#include <thread>
#include <utility>
#include <vector>

class Joined {
public:
    Joined() = default;
    Joined(const Joined&) = delete;
    Joined& operator=(const Joined&) = delete;
    ~Joined() { join(); }

    template <class... Args>
    void start(Args&&... args) { threads_.emplace_back(std::forward<Args>(args)...); }

    void join() {
        for (std::thread& t : threads_)
            if (t.joinable()) t.join();
    }

private:
    std::vector<std::thread> threads_;
};
