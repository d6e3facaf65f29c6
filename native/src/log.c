/* Diagnostics: one line per message on stderr, prefixed with the pid, filtered by
 * LIBCUDA_LOG_LEVEL (0 silent, 1 errors, 2 warnings (default), 3 info, 4 debug). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

#define DEFAULT_LEVEL VGPU_WARN

static int parse_level(void) {
    const char *text = getenv("LIBCUDA_LOG_LEVEL");
    if (text == NULL || *text == '\0') return DEFAULT_LEVEL;
    char *end = NULL;
    long value = strtol(text, &end, 10);
    if (*end != '\0' || value < 0 || value > 4) {
        /* Reported once: the level is parsed once per process. */
        char line[160];
        int n = snprintf(line, sizeof line, "[hami-vgpu pid=%d] WARN: LIBCUDA_LOG_LEVEL=%.40s is not 0-4; using %d\n",
                         (int)getpid(), text, DEFAULT_LEVEL);
        if (n > 0) (void)!write(STDERR_FILENO, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        return DEFAULT_LEVEL;
    }
    return (int)value;
}

static int current_level(void) {
    static int level = -1;
    int seen = __atomic_load_n(&level, __ATOMIC_RELAXED);
    if (seen < 0) {
        seen = parse_level();
        __atomic_store_n(&level, seen, __ATOMIC_RELAXED);
    }
    return seen;
}

void vgpu_log(int level, const char *fmt, ...) {
    if (level > current_level()) return;
    static const char *const names[] = {"", "ERROR", "WARN", "INFO", "DEBUG"};
    char line[512];
    int head = snprintf(line, sizeof line, "[hami-vgpu pid=%d] %s: ", (int)getpid(), names[level]);
    if (head < 0) return;
    va_list args;
    va_start(args, fmt);
    int body = vsnprintf(line + head, sizeof line - (size_t)head - 1, fmt, args);
    va_end(args);
    size_t len = (size_t)head + (body < 0 ? 0 : (size_t)body);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    /* One write per line, so lines of concurrent processes do not interleave. */
    (void)!write(STDERR_FILENO, line, len);
}
