// The CPU side of the offload runtime's decode step: a thread that follows the GPU layer by
// layer, computing the experts the GPU's plan kernel handed it (see offload_exchange.h for the
// protocol). It runs the same moe_ffn kernel as native.ops, on the page-locked host banks, with
// every pool thread helping; Python only arms it (begin_step) and collects it (wait_step).
#include "offload_worker.h"

#include <chrono>
#include <stdexcept>

namespace ft::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

OffloadWorker::OffloadWorker(const Exchange& ex, std::vector<WorkerLayer> layers, int64_t timeout_ms)
    : ex_(ex), layers_(std::move(layers)), timeout_ns_(timeout_ms * 1000000),
      busy_ns_(layers_.size(), 0), experts_(layers_.size(), 0) {
    thread_ = std::thread([this] { loop(); });
}

OffloadWorker::~OffloadWorker() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void OffloadWorker::begin_step(int32_t step, int n_tok) {
    std::lock_guard<std::mutex> lk(mu_);
    if (n_tok < 1 || n_tok > ex_.max_tok)
        throw std::invalid_argument("offload worker: n_tok out of range");
    if (step <= armed_)
        throw std::invalid_argument("offload worker: step " + std::to_string(step) +
                                    " armed after step " + std::to_string(armed_));
    queue_.emplace_back(step, n_tok);
    armed_ = step;
    cv_.notify_all();
}

void OffloadWorker::wait_step(int32_t upto) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return done_ >= std::min(upto, armed_); });
    if (!error_.empty()) {
        const std::string err = std::move(error_);
        error_.clear();
        throw std::runtime_error(err);
    }
}

int OffloadWorker::in_flight() {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int>(queue_.size()) + (running_ ? 1 : 0);
}

void OffloadWorker::loop() {
    for (;;) {
        std::pair<int32_t, int> job;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [this] { return quit_ || !queue_.empty(); });
            if (quit_) return;
            job = queue_.front();
            queue_.pop_front();
            running_ = true;
        }
        std::string err;
        hold_threads(true);   // the step's CPU calls start without waking the pool
        try {
            run_step(job.first, job.second);
        } catch (const std::exception& e) {
            err = e.what();
        }
        hold_threads(false);
        std::lock_guard<std::mutex> lk(mu_);
        if (error_.empty()) error_ = err;   // the first error of the steps since the last wait
        done_ = job.first;
        running_ = false;
        cv_.notify_all();
    }
}

void OffloadWorker::run_step(int32_t step, int n_tok) {
    const int T = n_tok, K = ex_.top_k;
    const int64_t H = ex_.hidden;
    for (size_t L = 0; L < layers_.size(); ++L) {
        const int64_t t_wait = now_ns();
        const int32_t* gflag = ex_.gpu_flag + L;
        while (__atomic_load_n(gflag, __ATOMIC_ACQUIRE) < step) {
            cpu_relax();
            if (now_ns() - t_wait > timeout_ns_)
                throw std::runtime_error("offload worker: the GPU did not reach MoE layer " +
                                         std::to_string(L) + " in time (step " +
                                         std::to_string(step) + ")");
        }
        const int64_t t0 = now_ns();
        const int32_t* ids = ex_.cpu_ids + L * ex_.max_tok * K;
        int n = 0;
        for (int i = 0; i < T * K; ++i) n += ids[i] >= 0;
        float* y = ex_.y_host + L * ex_.max_tok * H;
        const WorkerLayer& lw = layers_[L];
        if (n) {
            moe_ffn(ex_.x_host + L * ex_.max_tok * H, T, H, lw.ff, lw.n_experts, ids,
                    ex_.cpu_w + L * ex_.max_tok * K,
                    K, lw.gate, lw.up, lw.down, y);
        } else {
            for (int64_t i = 0; i < T * H; ++i) y[i] = 0.0f;
        }
        __atomic_store_n(ex_.cpu_flag + L, step, __ATOMIC_RELEASE);
        busy_ns_[L] += now_ns() - t0;
        experts_[L] += n;
    }
}

}  // namespace ft::cpu
