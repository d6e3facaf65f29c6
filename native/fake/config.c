/* Parser for the fake driver's configuration, a file or a directory of them (format in fake.h). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "fake.h"

int fake_parse_bytes(const char *text, uint64_t *out) {
    if (text == NULL || *text < '0' || *text > '9') return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0) return -1;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K') shift = 10;
    if (*end == 'm' || *end == 'M') shift = 20;
    if (*end == 'g' || *end == 'G') shift = 30;
    if (shift != 0) end++;
    if (*end != '\0' || (shift != 0 && value > (UINT64_MAX >> shift))) return -1;
    *out = (uint64_t)value << shift;
    return 0;
}

static int parse_number(const char *text, double *out) {
    char *end = NULL;
    errno = 0;
    double value = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !(value >= 0)) return -1;
    *out = value;
    return 0;
}

int fake_parse_uuid(const char *text, unsigned char out[16]) {
    if (strncmp(text, "GPU-", 4) != 0 && strncmp(text, "MIG-", 4) != 0) return -1;
    const char *p = text + 4;
    int n = 0;
    while (*p != '\0' && n < 16) {
        if (*p == '-') {
            p++;
            continue;
        }
        unsigned byte = 0;
        if (sscanf(p, "%2x", &byte) != 1 || p[1] == '\0' || p[1] == '-') return -1;
        out[n++] = (unsigned char)byte;
        p += 2;
    }
    return (n == 16 && *p == '\0') ? 0 : -1;
}

static void default_gpu(struct fake_gpu *gpu, int index) {
    memset(gpu, 0, sizeof *gpu);
    snprintf(gpu->uuid, sizeof gpu->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", index);
    snprintf(gpu->name, sizeof gpu->name, "NVIDIA Fake GPU");
    gpu->memory = 16ULL << 30;
    snprintf(gpu->pci, sizeof gpu->pci, "00000000:%02X:00.0", index + 1);
    gpu->healthy = 1;
    gpu->xid = 79;
    gpu->slot = index;
    gpu->nvlinks = -1;
    gpu->gi = gpu->ci = -1;
}

/* "nvswitch", "off" or a PCI bus id, each optionally "*N": the GPU's links in order. */
static int parse_nvlinks(struct fake_gpu *gpu, char *value) {
    gpu->nvlinks = 0;
    for (char *save = NULL, *end = strtok_r(value, ",", &save); end != NULL; end = strtok_r(NULL, ",", &save)) {
        long repeat = 1;
        char *star = strchr(end, '*');
        if (star != NULL) {
            char *rest = NULL;
            *star = '\0';
            repeat = strtol(star + 1, &rest, 10);
            if (star[1] == '\0' || *rest != '\0' || repeat < 1) return -1;
        }
        struct fake_link link = {.end = FAKE_LINK_GPU};
        if (strcmp(end, "off") == 0) {
            link.end = FAKE_LINK_OFF;
        } else if (strcmp(end, "nvswitch") == 0) {
            link.end = FAKE_LINK_SWITCH;
        } else {
            unsigned domain = 0, bus = 0, dev = 0, fn = 0;
            char extra = 0;
            if (sscanf(end, "%x:%x:%x.%x%c", &domain, &bus, &dev, &fn, &extra) != 4 || strlen(end) >= sizeof link.remote)
                return -1;
            snprintf(link.remote, sizeof link.remote, "%s", end);
        }
        for (long i = 0; i < repeat; i++) {
            if (gpu->nvlinks >= FAKE_MAX_NVLINKS) return -1;
            struct fake_link *out = &gpu->links[gpu->nvlinks];
            *out = link;
            if (link.end == FAKE_LINK_SWITCH)
                snprintf(out->remote, sizeof out->remote, "00000000:E%d:00.0", gpu->nvlinks % FAKE_NVSWITCHES);
            gpu->nvlinks++;
        }
    }
    return 0;
}

/* INTERNAL, PIX, PXB, PHB, NODE, SYS (nvidia-smi's names) or NVML's number; -1 if none. */
static int parse_level(const char *text) {
    static const struct {
        const char *name;
        int level;
    } names[] = {{"INTERNAL", 0}, {"PIX", 10}, {"PXB", 20}, {"PHB", 30}, {"NODE", 40}, {"SYS", 50}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(text, names[i].name) == 0) return names[i].level;
    }
    char *end = NULL;
    long level = strtol(text, &end, 10);
    return (*text != '\0' && *end == '\0' && level >= 0 && level < 1000) ? (int)level : -1;
}

int fake_p2p_level(const struct fake_config *cfg, int a, int b) {
    if (cfg->p2p[a][b] >= 0) return cfg->p2p[a][b];
    if (cfg->p2p_level >= 0) return cfg->p2p_level;
    return cfg->gpus[a].numa == cfg->gpus[b].numa ? 40 : 50;
}

/* Fills what the configuration left unset from its `topology` preset (format in fake.h). */
static int apply_topology(struct fake_config *cfg) {
    static const struct {
        const char *name;
        unsigned memory_gib;
    } boxes[] = {[FAKE_TOPOLOGY_NONE] = {"NVIDIA L40S", 48},
                 [FAKE_TOPOLOGY_HGX8] = {"NVIDIA H100 80GB HBM3", 80},
                 [FAKE_TOPOLOGY_PCIE_PAIRS8] = {"NVIDIA A100 80GB PCIe", 80}};
    if (cfg->topology == FAKE_TOPOLOGY_UNSET) return 0;
    if (cfg->count == 0) {
        for (int i = 0; i < 8; i++) {
            struct fake_gpu *gpu = &cfg->gpus[cfg->count++];
            default_gpu(gpu, i);
            snprintf(gpu->name, sizeof gpu->name, "%s", boxes[cfg->topology].name);
            gpu->memory = (uint64_t)boxes[cfg->topology].memory_gib << 30;
            gpu->numa = i / 4;
        }
    }
    if (cfg->topology == FAKE_TOPOLOGY_NONE) return 0;
    for (int i = 0; i < cfg->count; i++) {
        struct fake_gpu *gpu = &cfg->gpus[i];
        if (cfg->topology == FAKE_TOPOLOGY_HGX8) {
            if (gpu->nvlinks < 0) {
                char links[] = "nvswitch*18";
                if (parse_nvlinks(gpu, links) != 0) return -1;
            }
            continue;
        }
        int peer = i ^ 1;
        if (peer >= cfg->count) continue;
        if (gpu->nvlinks < 0) {
            char links[64];
            snprintf(links, sizeof links, "%s*12", cfg->gpus[peer].pci);
            if (parse_nvlinks(gpu, links) != 0) return -1;
        }
        if (cfg->p2p[i][peer] < 0) cfg->p2p[i][peer] = 10;
    }
    return 0;
}

static int fail(const char *file, int line, const char *what, const char *text) {
    fprintf(stderr, "hami-py fake driver: %s:%d: %s: %.80s\n", file, line, what, text);
    return -1;
}

/* Next `key=value` of a gpu line (value optionally "quoted"); NULL at the end. */
static char *next_pair(char **cursor, char **value) {
    char *p = *cursor;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '\0') return NULL;
    char *key = p;
    while (*p != '\0' && *p != '=' && *p != ' ') p++;
    if (*p != '=') return NULL;
    *p++ = '\0';
    if (*p == '"') {
        *value = ++p;
        while (*p != '\0' && *p != '"') p++;
        if (*p == '"') *p++ = '\0';
    } else {
        *value = p;
        while (*p != '\0' && *p != ' ' && *p != '\t') p++;
        if (*p != '\0') *p++ = '\0';
    }
    *cursor = p;
    return key;
}

static int parse_gpu(struct fake_config *cfg, const char *file, int lineno, char *rest) {
    if (cfg->count >= FAKE_MAX_GPUS) return fail(file, lineno, "too many gpus", rest);
    struct fake_gpu *gpu = &cfg->gpus[cfg->count];
    default_gpu(gpu, cfg->count);
    char *value = NULL, *key = NULL;
    while ((key = next_pair(&rest, &value)) != NULL) {
        unsigned char bytes[16];
        if (strcmp(key, "uuid") == 0) {
            if (fake_parse_uuid(value, bytes) != 0)
                return fail(file, lineno, "bad uuid (GPU- or MIG-8-4-4-4-12 hex)", value);
            snprintf(gpu->uuid, sizeof gpu->uuid, "%s", value);
        } else if (strcmp(key, "name") == 0) {
            snprintf(gpu->name, sizeof gpu->name, "%s", value);
        } else if (strcmp(key, "memory") == 0) {
            if (fake_parse_bytes(value, &gpu->memory) != 0) return fail(file, lineno, "bad memory", value);
        } else if (strcmp(key, "numa") == 0) {
            gpu->numa = atoi(value);
        } else if (strcmp(key, "pci") == 0) {
            snprintf(gpu->pci, sizeof gpu->pci, "%s", value);
        } else if (strcmp(key, "healthy") == 0) {
            gpu->healthy = strcmp(value, "false") != 0 && strcmp(value, "0") != 0;
        } else if (strcmp(key, "slot") == 0) {
            char *end = NULL;
            long slot = strtol(value, &end, 10);
            if (*value == '\0' || *end != '\0' || slot < 0 || slot >= FAKE_MAX_GPUS) return fail(file, lineno, "bad slot", value);
            gpu->slot = (int)slot;
        } else if (strcmp(key, "xid") == 0) {
            gpu->xid = (unsigned)strtoul(value, NULL, 10);
        } else if (strcmp(key, "nvlinks") == 0) {
            char copy[1024];
            snprintf(copy, sizeof copy, "%s", value);
            if (parse_nvlinks(gpu, copy) != 0)
                return fail(file, lineno, "bad nvlinks (nvswitch|off|<pci bus id>[*N], at most 18)", value);
        } else if (strcmp(key, "mig") == 0) {
            if (strcmp(value, "on") != 0 && strcmp(value, "off") != 0) return fail(file, lineno, "bad mig (on|off)", value);
            gpu->mig = strcmp(value, "on") == 0;
        } else if (strcmp(key, "mig_instances") == 0) {
            if (strlen(value) >= sizeof gpu->mig_instances) return fail(file, lineno, "mig_instances too long", value);
            snprintf(gpu->mig_instances, sizeof gpu->mig_instances, "%s", value);
        } else {
            return fail(file, lineno, "unknown gpu key", key);
        }
    }
    if (*rest != '\0') return fail(file, lineno, "expected key=value", rest);
    char why[160];
    if (fake_mig_check_config(gpu, why, sizeof why) != 0) return fail(file, lineno, why, gpu->mig_instances);
    cfg->count++;
    return 0;
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r')) *--end = '\0';
    return s;
}

/* Reads one configuration file into cfg, after what earlier files of a directory set. */
static int load_file(struct fake_config *cfg, const char *file) {
    FILE *f = fopen(file, "re");
    if (f == NULL) {
        fprintf(stderr, "hami-py fake driver: cannot read HAMIPY_FAKE_GPU_CONFIG file %s: %s\n", file, strerror(errno));
        return -1;
    }
    char buf[1024];
    int lineno = 0, rc = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f) != NULL) {
        lineno++;
        char *hash = strchr(buf, '#');
        if (hash != NULL && memchr(buf, '"', (size_t)(hash - buf)) == NULL) *hash = '\0';
        char *line = trim(buf);
        if (*line == '\0') continue;
        if (strncmp(line, "gpu", 3) == 0 && (line[3] == ' ' || line[3] == '\t' || line[3] == '\0')) {
            rc = parse_gpu(cfg, file, lineno, line + 3);
            continue;
        }
        char *eq = strchr(line, '=');
        if (eq == NULL) {
            rc = fail(file, lineno, "expected `key = value` or a gpu line", line);
            break;
        }
        *eq = '\0';
        char *key = trim(line), *value = trim(eq + 1);
        if (strcmp(key, "driver_version") == 0) {
            snprintf(cfg->driver_version, sizeof cfg->driver_version, "%s", value);
        } else if (strcmp(key, "cuda_version") == 0) {
            cfg->cuda_version = atoi(value);
        } else if (strcmp(key, "context_memory") == 0) {
            if (fake_parse_bytes(value, &cfg->context_memory) != 0) rc = fail(file, lineno, "bad context_memory", value);
        } else if (strcmp(key, "kilothread_ns") == 0) {
            if (parse_number(value, &cfg->kilothread_ns) != 0) rc = fail(file, lineno, "bad kilothread_ns", value);
        } else if (strcmp(key, "host_pid_offset") == 0) {
            double number = 0;
            if (parse_number(value, &number) != 0 || number > 1e9) rc = fail(file, lineno, "bad host_pid_offset", value);
            else cfg->host_pid_offset = (unsigned)number;
        } else if (strcmp(key, "graph_ns") == 0 || strcmp(key, "launch_queue_ms") == 0 ||
                   strcmp(key, "util_sample_ms") == 0) {
            double number = 0;
            if (parse_number(value, &number) != 0) {
                rc = fail(file, lineno, "bad number", value);
            } else if (strcmp(key, "graph_ns") == 0) {
                cfg->graph_ns = (uint64_t)number;
            } else if (strcmp(key, "launch_queue_ms") == 0) {
                cfg->launch_queue_ns = (uint64_t)(number * 1e6);
            } else if (number < 1) {
                rc = fail(file, lineno, "util_sample_ms must be at least 1", value);
            } else {
                cfg->util_sample_ns = (uint64_t)(number * 1e6);
            }
        } else if (strcmp(key, "topology") == 0) {
            if (strcmp(value, "hgx8") == 0) cfg->topology = FAKE_TOPOLOGY_HGX8;
            else if (strcmp(value, "pcie-pairs8") == 0) cfg->topology = FAKE_TOPOLOGY_PCIE_PAIRS8;
            else if (strcmp(value, "none") == 0) cfg->topology = FAKE_TOPOLOGY_NONE;
            else rc = fail(file, lineno, "unknown topology (hgx8, pcie-pairs8, none)", value);
        } else if (strcmp(key, "p2p_level") == 0) {
            if ((cfg->p2p_level = parse_level(value)) < 0) rc = fail(file, lineno, "bad p2p_level", value);
        } else if (strncmp(key, "p2p ", 4) == 0 || strncmp(key, "p2p\t", 4) == 0) {
            int a = -1, b = -1, level = parse_level(value);
            char extra = 0;
            if (sscanf(key + 4, "%d %d %c", &a, &b, &extra) != 2 || a < 0 || b < 0 || a >= FAKE_MAX_GPUS ||
                b >= FAKE_MAX_GPUS || a == b) {
                rc = fail(file, lineno, "bad p2p pair (p2p <index> <index> = <level>)", key);
            } else if (level < 0) {
                rc = fail(file, lineno, "bad p2p level", value);
            } else {
                cfg->p2p[a][b] = cfg->p2p[b][a] = level;
            }
        } else if (strcmp(key, "state") == 0) {
            snprintf(cfg->state_path, sizeof cfg->state_path, "%s", value);
        } else {
            rc = fail(file, lineno, "unknown key", key);
        }
    }
    fclose(f);
    return rc;
}

static int visible(const struct dirent *entry) { return entry->d_name[0] != '.'; }

/* Byte order, not the locale's collation: the GPUs' order must not depend on the application's locale. */
static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

/* A directory's files, hidden ones left out, in name order, as one configuration. */
static int load_dir(struct fake_config *cfg) {
    struct dirent **entries = NULL;
    int n = scandir(cfg->path, &entries, visible, by_name);
    if (n < 0) {
        fprintf(stderr, "hami-py fake driver: cannot list HAMIPY_FAKE_GPU_CONFIG=%s: %s\n", cfg->path, strerror(errno));
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < n; i++) {
        char file[sizeof cfg->path + 256];
        if (rc == 0) {
            snprintf(file, sizeof file, "%s/%s", cfg->path, entries[i]->d_name);
            rc = load_file(cfg, file);
        }
        free(entries[i]);
    }
    free(entries);
    return rc;
}

int fake_config_load(struct fake_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->driver_version, sizeof cfg->driver_version, "550.54.15");
    cfg->cuda_version = 12040;
    cfg->launch_queue_ns = 10000000ULL;
    cfg->util_sample_ns = 100000000ULL;
    cfg->p2p_level = -1;
    memset(cfg->p2p, 0xff, sizeof cfg->p2p); /* -1: the default level */
    const char *path = getenv("HAMIPY_FAKE_GPU_CONFIG");
    /* A container's installed configuration: a process `kubectl exec` starts gets the container's
     * environment as the runtime was asked for it, without what the dev cluster's runtime added. */
    if ((path == NULL || *path == '\0') && access(FAKE_INSTALLED_CONFIG, R_OK) == 0) path = FAKE_INSTALLED_CONFIG;
    if (path == NULL || *path == '\0') {
        cfg->count = 1;
        default_gpu(&cfg->gpus[0], 0);
        snprintf(cfg->state_path, sizeof cfg->state_path, "/tmp/hamipy-fake-gpu.state");
        return 0;
    }
    snprintf(cfg->path, sizeof cfg->path, "%s", path);
    snprintf(cfg->state_path, sizeof cfg->state_path, "%s.state", path);
    struct stat st;
    int rc = (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) ? load_dir(cfg) : load_file(cfg, path);
    if (rc == 0) rc = apply_topology(cfg);
    for (int a = cfg->count; rc == 0 && a < FAKE_MAX_GPUS; a++) {
        for (int b = 0; b < FAKE_MAX_GPUS; b++) {
            if (cfg->p2p[a][b] >= 0) {
                fprintf(stderr, "hami-py fake driver: %s: p2p %d %d names a GPU past the last (%d GPUs)\n", path,
                        a, b, cfg->count);
                rc = -1;
                break;
            }
        }
    }
    return rc;
}
