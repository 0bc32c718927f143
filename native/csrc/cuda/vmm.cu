// Elastic device memory for the expert cache: CUDA virtual memory management.
//
// A pool reserves an address range once (nothing behind it) and maps physical memory into it
// chunk by chunk. Growing maps more chunks after the last; shrinking unmaps and frees chunks from
// the end. The pool's address never changes, so kernels and captured CUDA graphs that index its
// slots stay valid while the memory behind it comes and goes: that is what lets the cache lend
// VRAM to a prefill's workspace and take it back for decode.
//
// The driver's cuMem* functions are fetched through the runtime (cudaGetDriverEntryPointByVersion)
// so the extension needs no link against libcuda. Host code only; every call is synchronous.
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "offload_api.h"

namespace ft::cuda {
namespace {

struct Driver {
    CUresult (*get_error_string)(CUresult, const char**) = nullptr;
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
    CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
    CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
    CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
    CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                       unsigned long long) = nullptr;
    CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
    CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
};

template <class F>
void entry(const char* name, F& fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
        cudaGetLastError();
        throw std::runtime_error(std::string("the CUDA driver has no ") + name +
                                 " (virtual memory management needs driver >= 10.2)");
    }
    fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        entry("cuGetErrorString", d.get_error_string);
        entry("cuDeviceGet", d.device_get);
        entry("cuDeviceGetAttribute", d.device_attribute);
        entry("cuMemGetAllocationGranularity", d.granularity);
        entry("cuMemAddressReserve", d.reserve);
        entry("cuMemAddressFree", d.address_free);
        entry("cuMemCreate", d.create);
        entry("cuMemRelease", d.release);
        entry("cuMemMap", d.map);
        entry("cuMemUnmap", d.unmap);
        entry("cuMemSetAccess", d.set_access);
    });
    return d;
}

void check(CUresult r, const char* what) {
    if (r == CUDA_SUCCESS) return;
    const char* msg = nullptr;
    driver().get_error_string(r, &msg);
    throw std::runtime_error(std::string(what) + ": " + (msg ? msg : "CUDA driver error " + std::to_string(r)));
}

// Physical memory on the current device, pinned (not migratable), no export handles.
CUmemAllocationProp device_prop() {
    int ordinal = 0;
    if (cudaGetDevice(&ordinal) != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error("no current CUDA device");
    }
    CUdevice dev;
    check(driver().device_get(&dev, ordinal), "cuDeviceGet");
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

}  // namespace

bool vmm_supported() {
    try {
        const CUmemAllocationProp prop = device_prop();
        int ok = 0;
        check(driver().device_attribute(&ok, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        prop.location.id), "cuDeviceGetAttribute");
        return ok != 0;
    } catch (const std::runtime_error&) {
        return false;
    }
}

size_t vmm_granularity() {
    const CUmemAllocationProp prop = device_prop();
    size_t g = 0;
    check(driver().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
    return g;
}

uintptr_t vmm_reserve(size_t bytes) {
    CUdeviceptr va = 0;
    check(driver().reserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
    return static_cast<uintptr_t>(va);
}

void vmm_free(uintptr_t va, size_t bytes) {
    check(driver().address_free(static_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree");
}

uint64_t vmm_map(uintptr_t va, size_t bytes) {
    const Driver& d = driver();
    const CUmemAllocationProp prop = device_prop();
    CUmemGenericAllocationHandle h = 0;
    check(d.create(&h, bytes, &prop, 0), "cuMemCreate (out of device memory?)");
    const CUdeviceptr p = static_cast<CUdeviceptr>(va);
    CUresult r = d.map(p, bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        d.release(h);
        check(r, "cuMemMap");
    }
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(p, bytes, &access, 1);
    if (r != CUDA_SUCCESS) {
        d.unmap(p, bytes);
        d.release(h);
        check(r, "cuMemSetAccess");
    }
    return static_cast<uint64_t>(h);
}

void vmm_unmap(uintptr_t va, size_t bytes, uint64_t handle) {
    const Driver& d = driver();
    check(d.unmap(static_cast<CUdeviceptr>(va), bytes), "cuMemUnmap");
    check(d.release(static_cast<CUmemGenericAllocationHandle>(handle)), "cuMemRelease");
}

}  // namespace ft::cuda
