// llama.cpp's logits for a token sequence, for scripts/dev/fidelity.py --llama (section "CPU
// fidelity" of docs/BENCHMARKS.md). Built against a llama.cpp build outside this repository:
//   g++ -O2 -std=c++17 llama_logits.cpp -I$SRC/include -I$SRC/ggml/include -o llama_logits \
//       $B/src/libllama.a $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a \
//       -fopenmp -lpthread -ldl
// Usage: llama_logits MODEL TOKENS.i32 OUT.f32 KV THREADS MODE
//   TOKENS.i32  the token ids, int32; OUT.f32 gets [n_tokens, n_vocab] float32 logits
//   KV          f16 (llama.cpp's default cache) or f32
//   MODE        prompt (every token in one batch) or tokens (one decode call per token)
// Every layer on the CPU (n_gpu_layers = 0).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: %s MODEL TOKENS.i32 OUT.f32 f16|f32 THREADS prompt|tokens\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> toks;
    if (FILE* f = std::fopen(argv[2], "rb")) {
        int32_t t;
        while (std::fread(&t, 4, 1, f) == 1) toks.push_back(t);
        std::fclose(f);
    }
    const bool f32_kv = !std::strcmp(argv[4], "f32"), one_batch = !std::strcmp(argv[6], "prompt");
    const int threads = std::atoi(argv[5]), n = int(toks.size());
    if (n == 0 || n > 4096 || threads <= 0) {
        std::fprintf(stderr, "need 1-4096 tokens and a positive thread count\n");
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t(n);
    cp.n_threads = cp.n_threads_batch = threads;
    if (f32_kv) cp.type_k = cp.type_v = GGML_TYPE_F32;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) return 4;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> out(size_t(n) * n_vocab);
    const int step = one_batch ? n : 1;
    llama_batch b = llama_batch_init(step, 0, 1);
    for (int t0 = 0; t0 < n; t0 += step) {
        for (int i = 0; i < step; ++i) {
            b.token[i] = toks[t0 + i], b.pos[i] = t0 + i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = 1;
        }
        b.n_tokens = step;
        if (llama_decode(ctx, b)) return 5;
        for (int i = 0; i < step; ++i)
            std::memcpy(&out[size_t(t0 + i) * n_vocab], llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
    }
    llama_batch_free(b);
    FILE* f = std::fopen(argv[3], "wb");
    if (!f || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 6;
    std::fclose(f);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
