/* Every hooked name resolves to the interposer's wrapper through every path a program can take:
 * the exported symbol (RTLD_DEFAULT), dlsym on the driver's own handle, and (for driver entry
 * points) cuGetProcAddress and cuGetProcAddress_v2 with the name's base and version. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "common.h"

struct hook {
    const char *name, *base;
    int version, per_thread;
};

static const struct hook hooks[] = {
#define HOOK_CU(n, b, v, p) {#n, #b, v, p},
#define HOOK_NVML(n) {#n, NULL, 0, 0},
#include "hamipy/hooks.def"
#undef HOOK_CU
#undef HOOK_NVML
};

int main(void) {
    CHECK_RC(cuInit(0), CUDA_SUCCESS);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(cuda != NULL && nvml != NULL);
    int failures = 0;
    for (size_t i = 0; i < sizeof hooks / sizeof hooks[0]; i++) {
        const struct hook *h = &hooks[i];
        void *exported = dlsym(RTLD_DEFAULT, h->name);
        void *by_handle = dlsym(h->base != NULL ? cuda : nvml, h->name);
        Dl_info info;
        int ours = exported != NULL && dladdr(exported, &info) != 0 && strstr(info.dli_fname, "libvgpu.so") != NULL;
        int same = by_handle == exported;
        if (h->base != NULL) {
            void *v1 = NULL, *v2 = NULL;
            CUdriverProcAddressQueryResult status;
            cuuint64_t flags = h->per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
            CUresult rc1 = cuGetProcAddress(h->base, &v1, h->version, flags);
            CUresult rc2 = cuGetProcAddress_v2(h->base, &v2, h->version, flags, &status);
            same = same && rc1 == CUDA_SUCCESS && rc2 == CUDA_SUCCESS && v1 == exported && v2 == exported;
        }
        if (!ours || !same) {
            fprintf(stderr, "hook %s: exported=%p ours=%d by_handle=%p consistent=%d\n", h->name, exported, ours,
                    by_handle, same);
            failures++;
        }
    }
    if (failures != 0) return 1;
    printf("ok %zu hooks\n", sizeof hooks / sizeof hooks[0]);
    return 0;
}
