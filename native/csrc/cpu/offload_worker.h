// The CPU half of the offload decode step (see offload_exchange.h for the shared protocol).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu.h"
#include "offload_exchange.h"

namespace ft::cpu {

struct WorkerLayer {  // one MoE layer's host expert bank, as three strided views
    Bank gate, up, down;
    int64_t ff;         // F
    int64_t n_experts;  // E
};

// A thread that, for each step s armed with begin_step(s), waits for each layer's gpu_flag >= s,
// computes the experts listed for it (moe_ffn on all pool threads) into y_host, and sets
// cpu_flag = s. Steps queue in the order armed (the GPU runs them in that order), so the host can
// arm the next step while the GPU is still on this one. wait_step(upto) blocks until every step
// up to `upto` (default: all armed) is done and rethrows a worker error (e.g. a GPU timeout).
class OffloadWorker {
public:
    OffloadWorker(const Exchange& ex, std::vector<WorkerLayer> layers, int64_t timeout_ms);
    ~OffloadWorker();
    OffloadWorker(const OffloadWorker&) = delete;
    OffloadWorker& operator=(const OffloadWorker&) = delete;

    void begin_step(int32_t step, int n_tok);  // non-blocking; steps must increase
    void wait_step(int32_t upto = INT32_MAX);   // blocking; call with the GIL released
    int in_flight();                            // steps armed and not yet done
    const std::vector<int64_t>& busy_ns() const { return busy_ns_; }    // per layer, cumulative
    const std::vector<int64_t>& experts() const { return experts_; }    // per layer, cumulative

private:
    void loop();
    void run_step(int32_t step, int n_tok);

    Exchange ex_;
    std::vector<WorkerLayer> layers_;
    int64_t timeout_ns_;
    std::vector<int64_t> busy_ns_, experts_;
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::pair<int32_t, int>> queue_;   // (step, n_tok) armed, not yet started
    int32_t armed_ = 0, done_ = 0;                 // the last step armed, the last one finished
    bool running_ = false, quit_ = false;
    std::string error_;
};

}  // namespace ft::cpu
