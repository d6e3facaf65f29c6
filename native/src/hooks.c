/* How programs reach the driver, and how each path is sent to our wrappers.
 *
 * Three paths lead to a driver function: the exported symbol (a program linked against
 * libcuda.so.1 binds to our export first, since we are preloaded), dlsym (programs and runtimes
 * that dlopen libcuda or libnvidia-ml and look functions up; ctypes does this), and
 * cuGetProcAddress (cudart >= 11.3 and PyTorch get nearly every entry point this way). All three
 * answer from one table, built from hamipy/hooks.def: name -> our wrapper -> the real pointer.
 *
 * The real functions come from dlopen("libcuda.so.1") / dlopen("libnvidia-ml.so.1") and glibc's
 * own dlsym (found with dlvsym, since our dlsym shadows it). A handle lookup searches only that
 * library and its dependencies, so it yields the driver's function, never our export. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "vgpu.h"

typedef void *(*dlsym_fn)(void *, const char *);

/* dlsym can be called before sanitizer runtimes are initialised (ASan resolves its interceptors
 * with dlsym from its constructor), so the code on that path is not instrumented and calls no
 * intercepted libc function. */
#define EARLY __attribute__((no_sanitize("address", "undefined")))

struct hook {
    const char *name;
    const char *base; /* the name cuGetProcAddress is asked for; NULL for NVML */
    int min_version;
    int per_thread;
    void *wrapper;
};

static const struct hook hooks[VGPU_HOOK_COUNT] = {
#define HOOK_CU(n, b, v, p) [VGPU_FN_##n] = {#n, #b, v, p, (void *)&n},
#define HOOK_NVML(n) [VGPU_FN_##n] = {#n, NULL, 0, 0, (void *)&n},
#include "hamipy/hooks.def"
#undef HOOK_CU
#undef HOOK_NVML
};

static const char *const aux_names[VGPU_FN_COUNT] = {
#define AUX_CU(n) [VGPU_FN_##n] = #n,
#define AUX_NVML(n) [VGPU_FN_##n] = #n,
#include "aux.def"
#undef AUX_CU
#undef AUX_NVML
};

static int is_nvml(enum vgpu_fn_id id) {
    const char *name = id < VGPU_HOOK_COUNT ? hooks[id].name : aux_names[id];
    return strncmp(name, "nvml", 4) == 0;
}

static dlsym_fn real_dlsym_ptr;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;

EARLY static void find_real_dlsym(void) {
    /* glibc >= 2.34 defines dlsym in libc (GLIBC_2.34); older ones in libdl (GLIBC_2.2.5). */
    void *sym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (sym == NULL) sym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    real_dlsym_ptr = (dlsym_fn)sym;
}

EARLY static dlsym_fn real_dlsym(void) {
    pthread_once(&dlsym_once, find_real_dlsym);
    return real_dlsym_ptr;
}

static void *reals[VGPU_FN_COUNT];
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

static void resolve(int want_nvml) {
    dlsym_fn lookup = real_dlsym();
    const char *soname = want_nvml ? "libnvidia-ml.so.1" : "libcuda.so.1";
    void *lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL || lookup == NULL) {
        LOGW("cannot load %s: %s", soname, lib == NULL ? dlerror() : "no real dlsym");
        return;
    }
    for (int id = 0; id < VGPU_FN_COUNT; id++) {
        if (id == VGPU_HOOK_COUNT || is_nvml((enum vgpu_fn_id)id) != want_nvml) continue;
        const char *name = id < VGPU_HOOK_COUNT ? hooks[id].name : aux_names[id];
        void *fn = lookup(lib, name);
        __atomic_store_n(&reals[id], fn, __ATOMIC_RELEASE);
        if (fn == NULL) LOGD("%s: %s not found", soname, name);
    }
}

static void resolve_cuda(void) { resolve(0); }
static void resolve_nvml(void) { resolve(1); }

void *vgpu_real(enum vgpu_fn_id id) {
    void *fn = __atomic_load_n(&reals[id], __ATOMIC_ACQUIRE);
    if (fn != NULL) return fn;
    pthread_once(is_nvml(id) ? &nvml_once : &cuda_once, is_nvml(id) ? resolve_nvml : resolve_cuda);
    return __atomic_load_n(&reals[id], __ATOMIC_ACQUIRE);
}

EARLY static int same_name(const char *a, const char *b) {
    while (*a != '\0' && *a == *b) a++, b++;
    return *a == *b;
}

EARLY static int find_hook(const char *name) {
    if (name == NULL) return -1;
    if (!(name[0] == 'c' && name[1] == 'u') && !(name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l'))
        return -1;
    for (int id = 0; id < VGPU_HOOK_COUNT; id++) {
        if (same_name(hooks[id].name, name)) return id;
    }
    return -1;
}

EARLY HAMI_EXPORT void *dlsym(void *handle, const char *name) {
    dlsym_fn lookup = real_dlsym();
    if (lookup == NULL) return NULL;
    /* Known limit: for RTLD_NEXT, glibc resolves relative to the library calling it, which is now
     * this one; for names we do not hook the answer is the same except for libraries loaded
     * between the caller and us. */
    void *found = lookup(handle, name);
    int id = find_hook(name);
    if (found != NULL && id >= 0 && vgpu_real((enum vgpu_fn_id)id) != NULL) return hooks[id].wrapper;
    return found;
}

/* What cuGetProcAddress hands back for a symbol: our wrapper when the driver's answer is one of
 * the functions we hook (matched by address, else by the name/version/stream mapping of
 * hooks.def), the driver's pointer otherwise. */
static void *substitute(const char *symbol, void *fn, int version, cuuint64_t flags) {
    for (int id = 0; id < VGPU_HOOK_COUNT; id++) {
        if (hooks[id].base != NULL && vgpu_real((enum vgpu_fn_id)id) == fn) return hooks[id].wrapper;
    }
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (int pass = 0; pass < 2; pass++) {
        int best = -1;
        for (int id = 0; id < VGPU_HOOK_COUNT; id++) {
            const struct hook *h = &hooks[id];
            if (h->base == NULL || strcmp(h->base, symbol) != 0 || h->min_version > version) continue;
            if (h->per_thread != (pass == 0 ? want_ptds : 0)) continue;
            if (best < 0 || h->min_version > hooks[best].min_version) best = id;
        }
        if (best >= 0 && vgpu_real((enum vgpu_fn_id)best) != NULL) return hooks[best].wrapper;
        if (!want_ptds) break;
    }
    return fn;
}

HAMI_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    cuGetProcAddress_fn real = REAL(cuGetProcAddress);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL && *pfn != NULL && symbol != NULL)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return rc;
}

HAMI_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus) {
    cuGetProcAddress_v2_fn real = REAL(cuGetProcAddress_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL && *pfn != NULL && symbol != NULL)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return rc;
}
