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
    if (armed_) throw std::runtime_error("offload worker: begin_step while a step is in flight");
    if (n_tok < 1 || n_tok > ex_.max_tok)
        throw std::invalid_argument("offload worker: n_tok out of range");
    ex_.n_tok = n_tok;
    step_ = step;
    armed_ = true;
    done_ = false;
    error_.clear();
    cv_.notify_all();
}

void OffloadWorker::wait_step() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [this] { return done_ || !armed_; });
    armed_ = false;
    if (!error_.empty()) throw std::runtime_error(error_);
}

void OffloadWorker::loop() {
    for (;;) {
        int32_t step;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [this] { return quit_ || (armed_ && !done_); });
            if (quit_) return;
            step = step_;
        }
        std::string err;
        hold_threads(true);   // the step's CPU calls start without waking the pool
        try {
            run_step(step);
        } catch (const std::exception& e) {
            err = e.what();
        }
        hold_threads(false);
        std::lock_guard<std::mutex> lk(mu_);
        error_ = err;
        done_ = true;
        cv_.notify_all();
    }
}

void OffloadWorker::run_step(int32_t step) {
    const int T = ex_.n_tok, K = ex_.top_k;
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
