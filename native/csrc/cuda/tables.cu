// Device facts and the IQ lookup tables on each device.
//
// set_tables() keeps a host copy (one buffer, each table 16-byte aligned) and uploads it to the
// current device at once; another device gets it at its first kernel call there (a synchronous
// cudaMemcpy: do that first call outside stream capture). Kernels receive ft::Grids by value.
#include <array>
#include <mutex>

#include "cuda/common.cuh"

namespace ft::cuda {

void throw_cuda(cudaError_t err, const char* what) {
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(err) +
                             " (" + cudaGetErrorString(err) + ")");
}

namespace {

constexpr int kMaxDevices = 64;

int current_device() {
    int dev = 0;
    FT_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices) throw std::runtime_error("CUDA device index out of range");
    return dev;
}

// name -> bytes, in the order they are packed.
struct TableSpec {
    const char* name;
    size_t bytes;
};
constexpr TableSpec kTables[] = {
    {"iq2xxs", 256 * 8}, {"iq2xs", 512 * 8}, {"iq2s", 1024 * 8}, {"iq3xxs", 256 * 4},
    {"iq3s", 512 * 4},   {"iq1s", 2048 * 8}, {"ksigns", 128},    {"kvalues_iq4nl", 16},
    {"kvalues_mxfp4", 16}};
constexpr int kNumTables = sizeof(kTables) / sizeof(kTables[0]);

size_t table_offset(int i) {
    size_t off = 0;
    for (int j = 0; j < i; ++j) off += (kTables[j].bytes + 15) / 16 * 16;
    return off;
}

struct Store {
    std::mutex mu;
    std::vector<uint8_t> host;  // packed, empty until set
    uint64_t version = 0;
    struct Dev {
        void* buf = nullptr;
        uint64_t version = 0;
        Grids grids{};
    };
    std::array<Dev, kMaxDevices> dev{};
    std::array<DeviceInfo, kMaxDevices> info{};
    std::array<bool, kMaxDevices> info_ready{};
};

Store& store() {
    static Store s;
    return s;
}

// Upload the host copy to `dev` (the current device) if it is stale. Caller holds the lock.
void upload(Store& s, int dev) {
    Store::Dev& d = s.dev[dev];
    if (d.version == s.version && d.buf) return;
    if (!d.buf) FT_CUDA_CHECK(cudaMalloc(&d.buf, table_offset(kNumTables)));
    FT_CUDA_CHECK(cudaMemcpy(d.buf, s.host.data(), s.host.size(), cudaMemcpyHostToDevice));
    auto at = [&](int i) { return static_cast<const uint8_t*>(d.buf) + table_offset(i); };
    d.grids.iq2xxs = reinterpret_cast<const uint64_t*>(at(0));
    d.grids.iq2xs = reinterpret_cast<const uint64_t*>(at(1));
    d.grids.iq2s = reinterpret_cast<const uint64_t*>(at(2));
    d.grids.iq3xxs = reinterpret_cast<const uint32_t*>(at(3));
    d.grids.iq3s = reinterpret_cast<const uint32_t*>(at(4));
    d.grids.iq1s = reinterpret_cast<const uint64_t*>(at(5));
    d.grids.ksigns = at(6);
    d.grids.kvalues_iq4nl = reinterpret_cast<const int8_t*>(at(7));
    d.grids.kvalues_mxfp4 = reinterpret_cast<const int8_t*>(at(8));
    d.version = s.version;
}

}  // namespace

const DeviceInfo& device_info() {
    Store& s = store();
    const int dev = current_device();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.info_ready[dev]) {
        DeviceInfo& i = s.info[dev];
        FT_CUDA_CHECK(cudaDeviceGetAttribute(&i.sms, cudaDevAttrMultiProcessorCount, dev));
        FT_CUDA_CHECK(cudaDeviceGetAttribute(&i.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        s.info_ready[dev] = true;
    }
    return s.info[dev];
}

const Grids& device_grids(bool needed) {
    static const Grids none{};
    Store& s = store();
    const int dev = current_device();
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.host.empty()) {
        if (!needed) return none;
        throw std::invalid_argument("native._cuda: this type needs the IQ tables: call "
                                    "set_tables(loaders.quants.iq_tables()) first (native.ops does)");
    }
    upload(s, dev);
    return s.dev[dev].grids;
}

void set_tables(const std::map<std::string, std::vector<uint8_t>>& tables) {
    std::vector<uint8_t> packed(table_offset(kNumTables), 0);
    for (int i = 0; i < kNumTables; ++i) {
        auto it = tables.find(kTables[i].name);
        require(it != tables.end(), std::string("set_tables: missing table '") + kTables[i].name + "'");
        require(it->second.size() == kTables[i].bytes,
                std::string("set_tables: table '") + kTables[i].name + "' has " +
                    std::to_string(it->second.size()) + " bytes, expected " +
                    std::to_string(kTables[i].bytes));
        std::copy(it->second.begin(), it->second.end(), packed.begin() + table_offset(i));
    }
    Store& s = store();
    const int dev = current_device();
    std::lock_guard<std::mutex> lock(s.mu);
    s.host = std::move(packed);
    s.version += 1;
    upload(s, dev);
}

bool tables_ready() {
    Store& s = store();
    std::lock_guard<std::mutex> lock(s.mu);
    return !s.host.empty();
}

std::vector<std::string> type_names() {
    return {
#define FT_X(NAME, ...) #NAME,
        FT_QUANT_TYPES(FT_X)
#undef FT_X
    };
}

std::map<std::string, int> device_limits() {
    const DeviceInfo& i = device_info();
    return {{"sms", i.sms}, {"smem_optin", i.smem_optin}};
}

}  // namespace ft::cuda
