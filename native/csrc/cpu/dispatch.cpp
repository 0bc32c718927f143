// ISA choice (CPUID at load time, FTPATCH_CPU_ISA to override) and the IQ tables of the CPU side.
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include "cpu.h"

namespace ft::cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
#else
    return false;
#endif
}

bool cpu_has_avx512() {  // the VNNI int8 kernels: F, BW, DQ, VL and VNNI, on top of the AVX2 set
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

bool cpu_is_intel() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
#else
    return false;
#endif
}

struct Tables {
    IsaKernels generic, avx2, avx512;
    TypeKernels iq3s[2][2];  // [avx2, avx512][loads, gather]: each table's two IQ3_S forms
    std::string iq3s_grid;
    bool has_avx2 = cpu_has_avx2(), has_avx512 = cpu_has_avx512();
    std::atomic<const IsaKernels*> active{nullptr};
    void use_iq3s_grid(const std::string& how) {  // anything but "loads" is the gather
        const int form = how == "loads" ? 0 : 1;
        avx2.types[int(QType::IQ3_S)] = iq3s[0][form];
        if (has_avx512) avx512.types[int(QType::IQ3_S)] = iq3s[1][form];
        iq3s_grid = form ? "gather" : "loads";
    }
    Tables() {
        fill_generic(generic);
        avx2 = generic;
        avx2.name = "avx2";
        if (has_avx2) {
            fill_avx2(avx2);
            iq3s[0][0] = iq3s[0][1] = avx2.types[int(QType::IQ3_S)];
            ft_cpu_fill_avx2_iq3s_gather(&iq3s[0][1]);
        }
        avx512 = avx2;
        avx512.name = "avx512";
        if (has_avx512) {
            ft_cpu_fill_avx512(&avx512);
            iq3s[1][0] = iq3s[1][1] = avx512.types[int(QType::IQ3_S)];
            ft_cpu_fill_avx512_iq3s_loads(&iq3s[1][0]);
        }
        if (has_avx2) {
            const char* grid = std::getenv("FTPATCH_IQ3S_GRID");
            use_iq3s_grid(grid && *grid ? grid : cpu_is_intel() ? "gather" : "loads");
        }
        const char* env = std::getenv("FTPATCH_CPU_ISA");
        const std::string want = env ? env : "";
        if (want == "generic" || !has_avx2) active = &generic;
        else if (want == "avx2" || !has_avx512) active = &avx2;
        else active = &avx512;
    }
};

Tables& tables() {
    static Tables t;
    return t;
}

// IQ tables: name -> (bytes expected, storage)
struct GridStore {
    std::map<std::string, std::vector<uint8_t>> data;
    Grids grids{};
    std::atomic<bool> ready{false};
    std::mutex mu;
};
GridStore& store() {
    static GridStore s;
    return s;
}
const std::map<std::string, size_t>& table_sizes() {
    static const std::map<std::string, size_t> sizes = {
        {"iq2xxs", 256 * 8}, {"iq2xs", 512 * 8}, {"iq2s", 1024 * 8}, {"iq3xxs", 256 * 4},
        {"iq3s", 512 * 4},   {"iq1s", 2048 * 8}, {"ksigns", 128},    {"kvalues_iq4nl", 16},
        {"kvalues_mxfp4", 16}};
    return sizes;
}

}  // namespace

const IsaKernels& kernels() { return *tables().active.load(); }

std::vector<std::string> available_isas() {
    std::vector<std::string> out = {"generic"};
    if (tables().has_avx2) out.push_back("avx2");
    if (tables().has_avx512) out.push_back("avx512");
    return out;
}

void set_isa(const std::string& name) {
    Tables& t = tables();
    if (name == "generic") t.active = &t.generic;
    else if (name == "avx2" && t.has_avx2) t.active = &t.avx2;
    else if (name == "avx512" && t.has_avx512) t.active = &t.avx512;
    else {
        std::string have;
        for (const auto& n : available_isas()) have += (have.empty() ? "" : ", ") + n;
        throw std::invalid_argument("CPU ISA '" + name + "' is not available here; available: " + have);
    }
}

std::string iq3s_grid() { return tables().iq3s_grid; }

void set_iq3s_grid(const std::string& how) {
    Tables& t = tables();
    if (!t.has_avx2) throw std::invalid_argument("set_iq3s_grid: this CPU has no avx2 table");
    if (how != "gather" && how != "loads")
        throw std::invalid_argument("IQ3_S grid '" + how + "': give 'gather' or 'loads'");
    // a call in flight may read the entry while it changes: switch between calls only
    t.use_iq3s_grid(how);
}

const TypeKernels& type_kernels(const IsaKernels& isa, int type_id) {
    if (type_id < 0 || type_id >= kMaxTypeId || !isa.types[type_id].dot_row)
        throw std::invalid_argument("ggml type id " + std::to_string(type_id) +
                                    " has no CPU kernel (see native._cpu.matmul_types())");
    const TypeKernels& k = isa.types[type_id];
    if (k.needs_grids && !tables_ready())
        throw std::invalid_argument(std::string(k.name) + " needs the IQ tables: call set_tables() "
                                    "first (native.ops does at import)");
    return k;
}

const Grids& grids() { return store().grids; }
bool tables_ready() { return store().ready.load(); }

void set_table(const std::string& name, const void* data, size_t nbytes) {
    auto it = table_sizes().find(name);
    if (it == table_sizes().end()) throw std::invalid_argument("unknown IQ table '" + name + "'");
    if (it->second != nbytes)
        throw std::invalid_argument("IQ table '" + name + "' must be " + std::to_string(it->second) +
                                    " bytes, got " + std::to_string(nbytes));
    GridStore& s = store();
    std::lock_guard<std::mutex> lock(s.mu);
    auto& v = s.data[name];
    v.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + nbytes);
    auto p = [&](const char* key) -> const void* {
        auto f = s.data.find(key);
        return f == s.data.end() ? nullptr : f->second.data();
    };
    Grids& g = s.grids;
    g.iq2xxs = static_cast<const uint64_t*>(p("iq2xxs"));
    g.iq2xs = static_cast<const uint64_t*>(p("iq2xs"));
    g.iq2s = static_cast<const uint64_t*>(p("iq2s"));
    g.iq3xxs = static_cast<const uint32_t*>(p("iq3xxs"));
    g.iq3s = static_cast<const uint32_t*>(p("iq3s"));
    g.iq1s = static_cast<const uint64_t*>(p("iq1s"));
    g.ksigns = static_cast<const uint8_t*>(p("ksigns"));
    g.kvalues_iq4nl = static_cast<const int8_t*>(p("kvalues_iq4nl"));
    g.kvalues_mxfp4 = static_cast<const int8_t*>(p("kvalues_mxfp4"));
    s.ready = s.data.size() == table_sizes().size();
}

Act prepare_act(const IsaKernels& isa, const float* x, int64_t ldx, int64_t nt, int64_t n,
                ActBuf& buf, const ActNeeds& needs) {
    Act a;
    a.x = x;
    a.ldx = ldx;
    a.n = n;
    const bool q8 = isa.quantize_act && (needs.reads & kReadsQ8);
    const bool q16 = isa.quantize_act16 && (needs.reads & kReadsQ16);
    if (nt <= 0 || !(q8 || q16)) return a;
    if (q8) {
        buf.q8.reset(new int8_t[nt * n]);
        buf.d8.reset(new float[nt * (n / 32)]);
        buf.m16.reset(new float[nt * (n / 16)]);
        a.q8 = buf.q8.get();
        a.d8 = buf.d8.get();
        a.m16 = buf.m16.get();
    }
    if (q16) {
        buf.x16.reset(new int16_t[nt * n]);
        buf.dx16.reset(new float[nt * (n / 32)]);
        buf.sx16.reset(new float[nt * (n / 32)]);
        a.x16 = buf.x16.get();
        a.dx16 = buf.dx16.get();
        a.sx16 = buf.sx16.get();
    }
    // q8x serves the many-token path (nt > 4) of the 256-weight block types on AVX-512, and
    // IQ3_S's column-form decode: only for calls whose weights read it at nt tokens
    uint8_t* q8x = nullptr;
    if (q8 && needs.q8x_from > 0 && nt >= needs.q8x_from && isa.interleave_act && n % 256 == 0) {
        buf.q8x.reset(new uint8_t[nt * n + 63]);
        q8x = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.q8x.get()) + 63) & ~uintptr_t(63));
        a.q8x = q8x;
    }
    const int64_t grain = std::max<int64_t>(1, 16384 / n);
    auto fill = [&](int64_t t0, int64_t t1) {
        if (q8) isa.quantize_act(x, ldx, t0, t1, n, buf.q8.get(), buf.d8.get(), buf.m16.get());
        if (q8x) isa.interleave_act(buf.q8.get(), t0, t1, n, q8x);
        if (q16) isa.quantize_act16(x, ldx, t0, t1, n, buf.x16.get(), buf.dx16.get(), buf.sx16.get());
    };
    if (nt * n < 65536) fill(0, nt);  // one token: cheaper than waking the pool
    else parallel_for(nt, grain, fill);
    return a;
}

int64_t row_kblocks(const TypeKernels& k, int64_t n_cols, const char* what) {
    if (n_cols <= 0 || n_cols % k.kb_elems)
        throw std::invalid_argument(std::string(what) + ": a " + k.name + " row of " +
                                    std::to_string(n_cols) + " weights is not a whole number of " +
                                    std::to_string(k.kb_elems) + "-weight kernel blocks");
    return n_cols / k.kb_elems;
}

}  // namespace ft::cpu
