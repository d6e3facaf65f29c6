/* Helpers shared by the native test programs: checks that print what failed and exit 1. */
#ifndef HAMIPY_TEST_COMMON_H
#define HAMIPY_TEST_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_types.h"
#include "hamipy/region.h"

#define MiB (1024ULL * 1024ULL)

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* A CUresult or an nvmlReturn_t. */
#define CHECK_RC(expr, want)                                                                        \
    do {                                                                                            \
        int rc_ = (int)(expr);                                                                      \
        if (rc_ != (int)(want)) {                                                                   \
            fprintf(stderr, "%s:%d: %s returned %d, want %d\n", __FILE__, __LINE__, #expr, (int)rc_, \
                    (int)(want));                                                                   \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

#define CHECK_EQ(a, b)                                                                               \
    do {                                                                                             \
        unsigned long long a_ = (unsigned long long)(a), b_ = (unsigned long long)(b);               \
        if (a_ != b_) {                                                                              \
            fprintf(stderr, "%s:%d: %s == %llu, want %s == %llu\n", __FILE__, __LINE__, #a, a_, #b, b_); \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

/* cuInit + a context on device 0, made current. */
CUcontext test_context(void);
/* The region file (CUDA_DEVICE_MEMORY_SHARED_CACHE), mapped read-only. */
const struct hami_region *test_region(void);
/* This process's used[dev].total in the region (0 without a slot). */
uint64_t test_own_usage(int dev);
/* Sum of used[dev].total over live slots. */
uint64_t test_container_usage(int dev);

#endif
