// A persistent thread pool: N-1 workers plus the calling thread split every parallel_for.
// Workers spin (then yield) briefly after a job (decode calls come back-to-back, 40 layers per
// token) and then sleep on a condition variable, so an idle pool costs no CPU; hold_threads()
// keeps them spinning through longer gaps (a condition-variable wake-up of 15 threads costs tens
// of microseconds, as much as a small expert's whole computation). Workers may be pinned, one per
// CPU of the process's affinity set (set_pin_threads, env FTPATCH_PIN_THREADS=0|1); the calling
// thread never is (it is Python's, which also drives the GPU).
#include <pthread.h>
#include <sched.h>

#include <cstdlib>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_PAUSE() _mm_pause()
#else
#define FT_PAUSE() ((void)0)
#endif

namespace ft::cpu {
namespace {

using Fn = std::function<void(int64_t, int64_t)>;
constexpr auto kSpin = std::chrono::microseconds(100);
std::atomic<int> g_hold{0};  // > 0: idle workers do not sleep

int cores_available() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    const unsigned n = std::thread::hardware_concurrency();
    return n ? int(n) : 1;
}

bool pin_from_env() {
    const char* e = std::getenv("FTPATCH_PIN_THREADS");
    return e && e[0] == '1';
}
std::atomic<bool> g_pin{pin_from_env()};

// The CPUs this process may run on, in order (empty if unknown).
std::vector<int> allowed_cpus() {
    std::vector<int> cpus;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) cpus.push_back(c);
    return cpus;
}

// Worker i (1..n-1) on CPU cpus[i]: the caller keeps cpus[0] most of the time (the workers spin
// on the others).
void pin_worker(std::thread& t, int i, const std::vector<int>& cpus) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[i], &one);
    pthread_setaffinity_np(t.native_handle(), sizeof(one), &one);
}

// Waiting: a short spin (the other threads are usually microseconds away), then yield, so that on
// a busy machine a preempted pool thread (or the Python thread driving the GPU) gets the core.
inline void relax(int i) {
    if (i < 512) FT_PAUSE();
    else std::this_thread::yield();
}

class Pool {
  public:
    explicit Pool(int n_threads) {
        const std::vector<int> cpus = allowed_cpus();
        // not with more threads than CPUs: two pinned spinners on one core would take turns
        pinned_ = g_pin.load() && n_threads > 1 && n_threads <= int(cpus.size());
        for (int i = 1; i < n_threads; ++i) {
            workers_.emplace_back([this] { loop(); });
            if (pinned_) pin_worker(workers_.back(), i, cpus);
        }
    }
    bool pinned() const { return pinned_; }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            gen_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return int(workers_.size()) + 1; }

    void run(int64_t n, int64_t grain, const Fn& fn) {
        fn_ = &fn;
        n_ = n;
        grain_ = grain;
        next_.store(0);
        pending_.store(int(workers_.size()));
        {
            std::lock_guard<std::mutex> lock(mu_);
            gen_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        work();
        for (int i = 0; pending_.load(std::memory_order_acquire) != 0; ++i) relax(i);
    }

  private:
    void work() {
        for (;;) {
            const int64_t b = next_.fetch_add(grain_);
            if (b >= n_) return;
            (*fn_)(b, std::min(n_, b + grain_));
        }
    }
    void loop() {
        uint64_t seen = 0;  // the generation at construction: a job posted before this thread
                            // started running is still seen as new
        for (;;) {
            uint64_t g = gen_.load(std::memory_order_acquire);
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; g == seen; ++i) {
                relax(i);
                g = gen_.load(std::memory_order_acquire);
                if ((i & 255) == 255 && g_hold.load(std::memory_order_relaxed) == 0 &&
                    std::chrono::steady_clock::now() - t0 > kSpin) break;
            }
            if (g == seen) {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return gen_.load() != seen; });
                g = gen_.load();
            }
            seen = g;
            if (stop_) return;
            work();
            pending_.fetch_sub(1, std::memory_order_release);
        }
    }

    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> pending_{0};
    std::atomic<int64_t> next_{0};
    std::atomic<bool> stop_{false};  // set under mu_ with a generation bump
    const Fn* fn_ = nullptr;
    int64_t n_ = 0, grain_ = 1;
    bool pinned_ = false;
};

std::mutex g_run_mu;  // one parallel_for (or resize) at a time
Pool* g_pool = nullptr;  // never destroyed at exit: joining threads during interpreter teardown hangs

std::atomic<int> g_size{0};  // pool size, readable without waiting for a running job

// A new pool of n threads in place of the current one (under g_run_mu)
void rebuild(int n) {
    delete g_pool;
    g_pool = new Pool(n);
    g_size = g_pool->size();
}

Pool& pool() {
    if (!g_pool) rebuild(cores_available());
    return *g_pool;
}

}  // namespace

int num_threads() {
    if (const int n = g_size.load()) return n;
    std::lock_guard<std::mutex> lock(g_run_mu);
    return pool().size();
}

void set_num_threads(int n) {
    std::lock_guard<std::mutex> lock(g_run_mu);
    rebuild(n > 0 ? n : cores_available());
}

void hold_threads(bool on) { g_hold.fetch_add(on ? 1 : -1); }

void set_pin_threads(bool on) {
    std::lock_guard<std::mutex> lock(g_run_mu);
    if (g_pin.exchange(on) == on || !g_pool) return;
    rebuild(g_pool->size());  // so that its workers take the new placement
}

bool threads_pinned() {
    std::lock_guard<std::mutex> lock(g_run_mu);
    return pool().pinned();
}

void parallel_for(int64_t n, int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    std::lock_guard<std::mutex> lock(g_run_mu);
    Pool& p = pool();
    if (p.size() == 1 || n <= grain) {
        fn(0, n);
        return;
    }
    p.run(n, grain, fn);
}

}  // namespace ft::cpu
