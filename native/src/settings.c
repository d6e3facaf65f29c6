/* Where the interposer's settings come from: the limits file beside it, or else the environment
 * (docs/wire-format.md#limits-file).
 *
 * The device plugin writes each GPU container's limits into a file it mounts read-only at
 * <hook>/limits, beside <hook>/libvgpu.so, which /etc/ld.so.preload (read-only too) names. The
 * container's own env comes after the plugin's and wins, so while that file exists every setting
 * is read from it alone, and a name it does not hold is unset: CUDA_DEVICE_MEMORY_LIMIT_0 or
 * GPU_CORE_UTILIZATION_POLICY in the pod spec then changes nothing. The file is found from the
 * path this library was loaded from (dladdr), not from anything the container can set. Without it
 * (a process outside a container we served: the tests, a bare machine) the environment is read,
 * as HAMi-core does.
 *
 * A file that exists but cannot be read, or holds a line that is not NAME=value, is a fault of the
 * node, not a reason to run unlimited: it is reported once and every memory limit becomes 1 byte
 * (env.c), as a malformed limit does. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define MAX_SETTINGS 64
#define NAME_LEN 64
#define VALUE_LEN 512

static struct {
    pthread_once_t once;
    int from_file;
    int broken;
    int count;
    char path[4096];
    char names[MAX_SETTINGS][NAME_LEN];
    char values[MAX_SETTINGS][VALUE_LEN];
} S = {.once = PTHREAD_ONCE_INIT};

/* <directory of this library>/limits into S.path; 0, or -1 when the library's path is unknown. */
static int limits_path(void) {
    Dl_info info;
    if (dladdr((void *)limits_path, &info) == 0 || info.dli_fname == NULL) return -1;
    const char *slash = strrchr(info.dli_fname, '/');
    if (slash == NULL) return -1;
    int n = snprintf(S.path, sizeof S.path, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname,
                     HAMI_LIMITS_FILE);
    return n > 0 && (size_t)n < sizeof S.path ? 0 : -1;
}

/* One NAME=value line (newline stripped) into the table; -1 when malformed. */
static int add_line(char *line) {
    if (*line == '\0') return 0;
    char *eq = strchr(line, '=');
    if (eq == NULL || eq == line || (size_t)(eq - line) >= NAME_LEN || strlen(eq + 1) >= VALUE_LEN ||
        S.count >= MAX_SETTINGS)
        return -1;
    *eq = '\0';
    snprintf(S.names[S.count], NAME_LEN, "%s", line);
    snprintf(S.values[S.count], VALUE_LEN, "%s", eq + 1);
    S.count++;
    return 0;
}

static void load(void) {
    if (limits_path() != 0) return;
    FILE *f = fopen(S.path, "re");
    if (f == NULL) {
        if (errno == ENOENT) return; /* not a container we served: the environment */
        S.from_file = S.broken = 1;
        LOGE("limits file %s cannot be read (%s): every allocation is refused", S.path, strerror(errno));
        return;
    }
    S.from_file = 1;
    char line[NAME_LEN + VALUE_LEN + 2];
    while (fgets(line, sizeof line, f) != NULL) {
        size_t len = strlen(line);
        int whole = len > 0 && line[len - 1] == '\n';
        if (whole) line[--len] = '\0';
        if ((!whole && !feof(f)) || add_line(line) != 0) {
            S.broken = 1;
            LOGE("limits file %s holds a malformed line (%.64s): every allocation is refused", S.path, line);
            break;
        }
    }
    if (ferror(f) && !S.broken) {
        S.broken = 1;
        LOGE("limits file %s cannot be read (%s): every allocation is refused", S.path, strerror(errno));
    }
    fclose(f);
}

const char *vgpu_setting(const char *name) {
    pthread_once(&S.once, load);
    if (!S.from_file) return getenv(name);
    for (int i = 0; i < S.count; i++) {
        if (strcmp(S.names[i], name) == 0) return S.values[i];
    }
    return NULL;
}

int vgpu_settings_broken(void) {
    pthread_once(&S.once, load);
    return S.broken;
}

int vgpu_settings_from_file(void) {
    pthread_once(&S.once, load);
    return S.from_file;
}
