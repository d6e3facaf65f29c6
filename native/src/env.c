/* The interposer's limits (docs/wire-format.md#interposer-environment), parsed once per process from
 * vgpu_setting: the limits file beside the library, or else the environment (settings.c).
 *
 * A malformed value is reported once on stderr and handled fail-closed: a bad memory limit
 * makes that device's limit 1 byte (every allocation is refused with CUDA_ERROR_OUT_OF_MEMORY,
 * queries report a 1-byte GPU), because silently running without a limit would break the
 * isolation the pod asked for. A bad SM limit is reported and ignored (that device gets no
 * compute limit: a guessed one could starve the container or its neighbours), and a bad priority
 * falls back to the default. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define BAD_LIMIT 1ULL

int vgpu_parse_bytes(const char *text, uint64_t *out) {
    if (text == NULL || *text == '\0') return -1;
    for (const char *c = text; *c != '\0'; c++) {
        if (*c == '-' || *c == '+' || *c == ' ') return -1;
    }
    errno = 0;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0 || end == text) return -1;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    default: return -1;
    }
    if (*end != '\0') return -1;
    if (shift != 0 && value > (UINT64_MAX >> shift)) return -1;
    *out = (uint64_t)value << shift;
    return 0;
}

static int parse_percent(const char *text, uint64_t *out) {
    uint64_t value = 0;
    if (vgpu_parse_bytes(text, &value) != 0) return -1;
    for (const char *c = text; *c != '\0'; c++) {
        if (*c < '0' || *c > '9') return -1;
    }
    *out = value > 100 ? 100 : value;
    return 0;
}

static struct {
    uint64_t mem[HAMI_MAX_DEVICES];
    uint64_t sm[HAMI_MAX_DEVICES];
    int priority;
} parsed;
static pthread_once_t parsed_once = PTHREAD_ONCE_INIT;

static void read_limit(const char *name, int percent, uint64_t fallback, uint64_t bad, uint64_t *out) {
    const char *text = vgpu_setting(name);
    if (text == NULL || *text == '\0') {
        *out = fallback;
        return;
    }
    int rc = percent ? parse_percent(text, out) : vgpu_parse_bytes(text, out);
    if (rc != 0) {
        LOGE("%s=%.64s is not a valid %s; using %s", name, text,
             percent ? "percentage" : "size (bytes with optional k/m/g)",
             percent ? "no core limit" : "a 1-byte limit (every allocation is refused)");
        *out = bad;
    }
}

static void parse_env(void) {
    uint64_t mem_all = 0, sm_all = 0;
    read_limit("CUDA_DEVICE_MEMORY_LIMIT", 0, 0, BAD_LIMIT, &mem_all);
    read_limit("CUDA_DEVICE_SM_LIMIT", 1, 0, 0, &sm_all);
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
        char name[48];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        read_limit(name, 0, mem_all, BAD_LIMIT, &parsed.mem[i]);
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        read_limit(name, 1, sm_all, 0, &parsed.sm[i]);
    }
    if (vgpu_settings_broken()) {
        for (int i = 0; i < HAMI_MAX_DEVICES; i++) parsed.mem[i] = BAD_LIMIT;
    }
    parsed.priority = 1;
    const char *prio = vgpu_setting("CUDA_TASK_PRIORITY");
    if (prio != NULL && *prio != '\0') {
        char *end = NULL;
        long value = strtol(prio, &end, 10);
        if (*end != '\0' || value < 0 || value > 1000) {
            LOGE("CUDA_TASK_PRIORITY=%.32s is not a small integer; using 1", prio);
        } else {
            parsed.priority = (int)value;
        }
    }
}

void vgpu_env_limits(uint64_t mem[HAMI_MAX_DEVICES], uint64_t sm[HAMI_MAX_DEVICES]) {
    pthread_once(&parsed_once, parse_env);
    memcpy(mem, parsed.mem, sizeof parsed.mem);
    memcpy(sm, parsed.sm, sizeof parsed.sm);
}

int vgpu_env_priority(void) {
    pthread_once(&parsed_once, parse_env);
    return parsed.priority;
}
