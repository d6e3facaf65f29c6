/* The fake driver's MIG: each MIG-capable model's GPU-instance profiles and placements, and the
 * GPU and compute instances, kept in the shared state so that every process (the device plugin
 * that creates them, the monitor, the containers that use them) sees the same ones.
 *
 * Profile tables. Profile ids (what create and placement calls take) are the ones the driver
 * reports (`nvidia-smi mig -lgip`: 1g 19, 1g+me 20, 1g double memory 15, 2g 14, 3g 9, 4g 5, 7g 0).
 * Memory, SM, copy-engine and media counts are those of NVIDIA's NVML mock (github.com/NVIDIA/
 * go-nvml, pkg/nvml/mock/dgxa100 and pkg/nvml/mock/shared/gpus/{a100,h100,h200}.go); the names
 * and the placements (1g starts 0..6 size 1, the 1g double-memory profile 0,2,4,6 size 2, 2g
 * 0,2,4 size 2, 3g 0,4 size 4, 4g 0 size 4, 7g 0 size 8) are those of NVIDIA's MIG user guide
 * (docs.nvidia.com/datacenter/tesla/mig-user-guide, "Supported MIG Profiles") and of
 * `nvidia-smi mig -lgipp` on these GPUs. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "nvml_types.h"

#define ONE_SLICE 0u
#define TWO_SLICE 1u
#define THREE_SLICE 2u
#define FOUR_SLICE 3u
#define SEVEN_SLICE 4u
#define ONE_SLICE_REV1 7u /* +me: the media engines */
#define ONE_SLICE_REV2 9u /* twice the memory of a 1g slice */

#define STARTS_1G 7, {0, 1, 2, 3, 4, 5, 6}
#define STARTS_1G_DOUBLE 4, {0, 2, 4, 6}
#define STARTS_2G 3, {0, 2, 4}
#define STARTS_3G 2, {0, 4}
#define STARTS_ONE 1, {0}

/* index, id, name, slices, instances, SMs, CE, NVDEC, NVENC, JPEG, OFA, memory MiB, placement size, starts */
static const struct fake_gi_profile a100_40gb[] = {
    {ONE_SLICE, 19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864, 1, STARTS_1G},
    {ONE_SLICE_REV1, 20, "1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864, 1, STARTS_1G},
    {ONE_SLICE_REV2, 15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9856, 2, STARTS_1G_DOUBLE},
    {TWO_SLICE, 14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9856, 2, STARTS_2G},
    {THREE_SLICE, 9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 19968, 4, STARTS_3G},
    {FOUR_SLICE, 5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 19968, 4, STARTS_ONE},
    {SEVEN_SLICE, 0, "7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40192, 8, STARTS_ONE},
};

static const struct fake_gi_profile a100_80gb[] = {
    {ONE_SLICE, 19, "1g.10gb", 1, 7, 14, 1, 0, 0, 0, 0, 9856, 1, STARTS_1G},
    {ONE_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 9856, 1, STARTS_1G},
    {ONE_SLICE_REV2, 15, "1g.20gb", 1, 4, 14, 1, 1, 0, 0, 0, 19968, 2, STARTS_1G_DOUBLE},
    {TWO_SLICE, 14, "2g.20gb", 2, 3, 28, 2, 1, 0, 0, 0, 19968, 2, STARTS_2G},
    {THREE_SLICE, 9, "3g.40gb", 3, 2, 42, 3, 2, 0, 0, 0, 40192, 4, STARTS_3G},
    {FOUR_SLICE, 5, "4g.40gb", 4, 1, 56, 4, 2, 0, 0, 0, 40192, 4, STARTS_ONE},
    {SEVEN_SLICE, 0, "7g.80gb", 7, 1, 98, 7, 5, 0, 1, 1, 80384, 8, STARTS_ONE},
};

static const struct fake_gi_profile h100_80gb[] = {
    {ONE_SLICE, 19, "1g.10gb", 1, 7, 16, 1, 1, 0, 0, 0, 10240, 1, STARTS_1G},
    {ONE_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 10240, 1, STARTS_1G},
    {ONE_SLICE_REV2, 15, "1g.20gb", 1, 4, 16, 1, 1, 0, 0, 0, 20480, 2, STARTS_1G_DOUBLE},
    {TWO_SLICE, 14, "2g.20gb", 2, 3, 32, 2, 1, 0, 0, 0, 20480, 2, STARTS_2G},
    {THREE_SLICE, 9, "3g.40gb", 3, 2, 48, 3, 2, 0, 0, 0, 40960, 4, STARTS_3G},
    {FOUR_SLICE, 5, "4g.40gb", 4, 1, 64, 4, 2, 0, 0, 0, 40960, 4, STARTS_ONE},
    {SEVEN_SLICE, 0, "7g.80gb", 7, 1, 112, 7, 5, 0, 0, 0, 81920, 8, STARTS_ONE},
};

static const struct fake_gi_profile h200_141gb[] = {
    {ONE_SLICE, 19, "1g.18gb", 1, 7, 16, 1, 1, 0, 0, 0, 18432, 1, STARTS_1G},
    {ONE_SLICE_REV1, 20, "1g.18gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 18432, 1, STARTS_1G},
    {ONE_SLICE_REV2, 15, "1g.35gb", 1, 4, 16, 1, 1, 0, 0, 0, 35840, 2, STARTS_1G_DOUBLE},
    {TWO_SLICE, 14, "2g.35gb", 2, 3, 32, 2, 1, 0, 0, 0, 35840, 2, STARTS_2G},
    {THREE_SLICE, 9, "3g.71gb", 3, 2, 48, 3, 2, 0, 0, 0, 72704, 4, STARTS_3G},
    {FOUR_SLICE, 5, "4g.71gb", 4, 1, 64, 4, 2, 0, 0, 0, 72704, 4, STARTS_ONE},
    {SEVEN_SLICE, 0, "7g.141gb", 7, 1, 112, 7, 5, 0, 0, 0, 144384, 8, STARTS_ONE},
};

#define TABLE(name, t) {name, sizeof t / sizeof t[0], t}
static const struct fake_mig_model models[] = {
    TABLE("A100 40GB", a100_40gb),
    TABLE("A100 80GB", a100_80gb),
    TABLE("H100 80GB", h100_80gb),
    TABLE("H200 141GB", h200_141gb),
};
#undef TABLE

const struct fake_mig_model *fake_mig_model_at(uint32_t model) {
    return model >= 1 && model <= sizeof models / sizeof models[0] ? &models[model - 1] : NULL;
}

/* 1 + the table index of a GPU's model, 0 without MIG: A100 (40 or 80 GB, by the name, else by
 * the configured memory), H100, H200. A resolved MIG device is not itself MIG-capable. */
static uint32_t model_number(const struct fake_gpu *gpu) {
    if (gpu->gi >= 0 || strncmp(gpu->uuid, "MIG-", 4) == 0) return 0;
    if (strstr(gpu->name, "A100") != NULL) {
        if (strstr(gpu->name, "80GB") != NULL) return 2;
        if (strstr(gpu->name, "40GB") != NULL) return 1;
        return gpu->memory > (48ULL << 30) ? 2 : 1;
    }
    if (strstr(gpu->name, "H100") != NULL) return 3;
    if (strstr(gpu->name, "H200") != NULL) return 4;
    return 0;
}

const struct fake_mig_model *fake_mig_model_of(const struct fake_gpu *gpu) {
    return fake_mig_model_at(model_number(gpu));
}

const struct fake_gi_profile *fake_mig_profile_by_id(const struct fake_mig_model *model, unsigned id) {
    for (unsigned i = 0; model != NULL && i < model->nprofiles; i++) {
        if (model->profiles[i].id == id) return &model->profiles[i];
    }
    return NULL;
}

const struct fake_gi_profile *fake_mig_profile_by_index(const struct fake_mig_model *model, unsigned index) {
    for (unsigned i = 0; model != NULL && i < model->nprofiles; i++) {
        if (model->profiles[i].index == index) return &model->profiles[i];
    }
    return NULL;
}

static const struct fake_gi_profile *profile_by_name(const struct fake_mig_model *model, const char *name) {
    for (unsigned i = 0; model != NULL && i < model->nprofiles; i++) {
        if (strcmp(model->profiles[i].name, name) == 0) return &model->profiles[i];
    }
    return NULL;
}

static int overlaps(const struct fake_mig_gpu *m, unsigned start, unsigned size) {
    for (int g = 0; g < FAKE_MAX_GIS; g++) {
        const struct fake_mig_gi *gi = &m->gis[g];
        if (gi->live && start < gi->start + gi->size && gi->start < start + size) return 1;
    }
    return 0;
}

static unsigned live_of_profile(const struct fake_mig_gpu *m, const struct fake_mig_model *model,
                                const struct fake_gi_profile *p) {
    unsigned n = 0;
    for (int g = 0; g < FAKE_MAX_GIS; g++) n += m->gis[g].live && &model->profiles[m->gis[g].profile] == p;
    return n;
}

static int has_start(const struct fake_gi_profile *p, unsigned start) {
    for (unsigned i = 0; i < p->nstarts; i++) {
        if (p->starts[i] == start) return 1;
    }
    return 0;
}

unsigned fake_mig_gi_capacity(const struct fake_mig_gpu *m, const struct fake_mig_model *model,
                              const struct fake_gi_profile *p) {
    unsigned live = live_of_profile(m, model, p);
    if (live >= p->instances) return 0;
    /* Equal-size intervals taken greedily in start order: the most that still fit. */
    unsigned n = 0, end = 0;
    for (unsigned i = 0; i < p->nstarts; i++) {
        unsigned s = p->starts[i];
        if (s >= end && !overlaps(m, s, p->size)) {
            n++;
            end = s + p->size;
        }
    }
    return n < p->instances - live ? n : p->instances - live;
}

/* Places a GPU instance in m (the caller holds the state lock or owns m); NVML's code. */
static int place_gi(struct fake_mig_gpu *m, const struct fake_mig_model *model, const struct fake_gi_profile *p,
                    int start, unsigned *gi_id) {
    if (start >= 0 && !has_start(p, (unsigned)start)) return NVML_ERROR_INVALID_ARGUMENT;
    if (live_of_profile(m, model, p) >= p->instances) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (start < 0) {
        for (unsigned i = 0; i < p->nstarts && start < 0; i++) {
            if (!overlaps(m, p->starts[i], p->size)) start = (int)p->starts[i];
        }
        if (start < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    } else if (overlaps(m, (unsigned)start, p->size)) {
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    /* The whole GPU's instance is id 0, as on the real driver; the others take the lowest free id. */
    int id = -1;
    for (int g = p->slices == 7 ? 0 : 1; g < FAKE_MAX_GIS && id < 0; g++) {
        if (!m->gis[g].live) id = g;
    }
    if (id < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    struct fake_mig_gi *gi = &m->gis[id];
    memset(gi, 0, sizeof *gi);
    gi->live = 1;
    gi->profile = (uint32_t)(p - model->profiles);
    gi->start = (uint32_t)start;
    gi->size = p->size;
    *gi_id = (unsigned)id;
    return NVML_SUCCESS;
}

/* A random (version 4) UUID with the MIG- prefix. */
static void new_uuid(char out[FAKE_MIG_UUID_LEN]) {
    unsigned char b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        srandom((unsigned)(ts.tv_nsec ^ getpid()));
        for (size_t i = 0; i < sizeof b; i++) b[i] = (unsigned char)random();
    }
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    snprintf(out, FAKE_MIG_UUID_LEN,
             "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* ---- compute instances: CI profile sizes 1, 2, 3, 4, 7 compute slices */

static const unsigned ci_sizes[] = {1, 2, 3, 4, 7}; /* by NVML_COMPUTE_INSTANCE_PROFILE_1..7_SLICE */

unsigned fake_mig_ci_slices(unsigned gi_slices, unsigned ci_profile) {
    if (ci_profile >= sizeof ci_sizes / sizeof ci_sizes[0]) return 0;
    unsigned c = ci_sizes[ci_profile];
    /* A 4-slice GI has no 3-slice CI; the others take any size up to theirs. */
    if (c > gi_slices || (gi_slices == 4 && c == 3)) return 0;
    return c;
}

static int ci_free_at(const struct fake_mig_gi *gi, unsigned start, unsigned size) {
    for (int c = 0; c < FAKE_MAX_CIS; c++) {
        const struct fake_mig_ci *ci = &gi->cis[c];
        if (ci->live && start < ci->start + ci->size && ci->start < start + size) return 0;
    }
    return 1;
}

unsigned fake_mig_ci_capacity(const struct fake_mig_gi *gi, unsigned gi_slices, unsigned ci_profile) {
    unsigned size = fake_mig_ci_slices(gi_slices, ci_profile), n = 0;
    for (unsigned s = 0; size != 0 && s + size <= gi_slices; s += size) n += ci_free_at(gi, s, size);
    return n;
}

static int place_ci(struct fake_mig_gi *gi, unsigned gi_slices, unsigned ci_profile, unsigned *ci_id) {
    unsigned size = fake_mig_ci_slices(gi_slices, ci_profile);
    if (size == 0) return NVML_ERROR_NOT_SUPPORTED;
    int start = -1;
    for (unsigned s = 0; s + size <= gi_slices && start < 0; s += size) {
        if (ci_free_at(gi, s, size)) start = (int)s;
    }
    int id = -1;
    for (int c = 0; c < FAKE_MAX_CIS && id < 0; c++) {
        if (!gi->cis[c].live) id = c;
    }
    if (start < 0 || id < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    struct fake_mig_ci *ci = &gi->cis[id];
    memset(ci, 0, sizeof *ci);
    ci->live = 1;
    ci->profile = ci_profile;
    ci->start = (uint32_t)start;
    ci->size = size;
    new_uuid(ci->uuid);
    *ci_id = (unsigned)id;
    return NVML_SUCCESS;
}

/* The compute-instance profile that takes a whole GI of `slices`. */
static unsigned full_ci_profile(unsigned slices) {
    for (unsigned i = 0; i < sizeof ci_sizes / sizeof ci_sizes[0]; i++) {
        if (ci_sizes[i] == slices) return i;
    }
    return 0;
}

/* ---- configuration: mig=on|off, mig_instances=<profile>@<start>,... */

/* Places the configured instances into m (a scratch copy or the state's); 0, or -1 with err. */
static int plan(const struct fake_gpu *gpu, struct fake_mig_gpu *m, char *err, size_t len) {
    const struct fake_mig_model *model = fake_mig_model_of(gpu);
    char list[sizeof gpu->mig_instances];
    snprintf(list, sizeof list, "%s", gpu->mig_instances);
    for (char *save = NULL, *item = strtok_r(list, ",", &save); item != NULL; item = strtok_r(NULL, ",", &save)) {
        char *at = strchr(item, '@'), *end = NULL;
        if (at == NULL) {
            snprintf(err, len, "bad mig_instances item %.40s (<profile>@<start>)", item);
            return -1;
        }
        *at = '\0';
        long start = strtol(at + 1, &end, 10);
        const struct fake_gi_profile *p = profile_by_name(model, item);
        if (p == NULL) {
            snprintf(err, len, "mig_instances: %.30s is not a %s profile", item, model->name);
            return -1;
        }
        unsigned gi = 0, ci = 0;
        int rc = at[1] == '\0' || *end != '\0' || start < 0 || start > 7
                     ? NVML_ERROR_INVALID_ARGUMENT
                     : place_gi(m, model, p, (int)start, &gi);
        if (rc == NVML_SUCCESS) rc = place_ci(&m->gis[gi], p->slices, full_ci_profile(p->slices), &ci);
        if (rc != NVML_SUCCESS) {
            snprintf(err, len, "mig_instances: %.30s@%.8s %s", item, at + 1,
                     rc == NVML_ERROR_INVALID_ARGUMENT ? "is not one of its placements"
                                                       : "overlaps another instance or is one too many");
            return -1;
        }
    }
    return 0;
}

int fake_mig_check_config(const struct fake_gpu *gpu, char *err, size_t len) {
    if (!gpu->mig && gpu->mig_instances[0] == '\0') return 0;
    if (fake_mig_model_of(gpu) == NULL) {
        snprintf(err, len, "MIG is not supported on %.60s", gpu->name);
        return -1;
    }
    if (!gpu->mig) {
        snprintf(err, len, "mig_instances needs mig=on");
        return -1;
    }
    struct fake_mig_gpu scratch;
    memset(&scratch, 0, sizeof scratch);
    return plan(gpu, &scratch, err, len);
}

void fake_mig_apply_config(struct fake_state *st, const struct fake_config *cfg) {
    for (int i = 0; i < cfg->count; i++) {
        const struct fake_gpu *gpu = &cfg->gpus[i];
        uint32_t model = model_number(gpu);
        if (model == 0 || gpu->slot < 0 || gpu->slot >= FAKE_MAX_GPUS) continue;
        struct fake_mig_gpu *m = &st->mig[gpu->slot];
        m->model = model;
        snprintf(m->name, sizeof m->name, "%s", gpu->name);
        snprintf(m->uuid, sizeof m->uuid, "%s", gpu->uuid);
        m->current = m->pending = gpu->mig ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
        char err[160];
        if (gpu->mig) (void)plan(gpu, m, err, sizeof err); /* checked when the configuration was read */
    }
}

/* ---- lookups and operations on the shared state */

void fake_mig_snapshot(struct fake_state *st, int slot, struct fake_mig_gpu *out) {
    fake_state_lock(st);
    *out = st->mig[slot];
    fake_state_unlock(st);
}

void fake_mig_resolve(struct fake_config *cfg, struct fake_state *st) {
    int kept = 0;
    fake_state_lock(st);
    for (int i = 0; i < cfg->count; i++) {
        struct fake_gpu *gpu = &cfg->gpus[i];
        int found = strncmp(gpu->uuid, "MIG-", 4) != 0;
        for (int s = 0; !found && s < FAKE_MAX_GPUS; s++) {
            const struct fake_mig_gpu *m = &st->mig[s];
            const struct fake_mig_model *model = fake_mig_model_at(m->model);
            for (int g = 0; !found && model != NULL && g < FAKE_MAX_GIS; g++) {
                for (int c = 0; !found && m->gis[g].live && c < FAKE_MAX_CIS; c++) {
                    if (!m->gis[g].cis[c].live || strcmp(m->gis[g].cis[c].uuid, gpu->uuid) != 0) continue;
                    const struct fake_gi_profile *p = &model->profiles[m->gis[g].profile];
                    found = 1;
                    gpu->slot = s;
                    gpu->gi = g;
                    gpu->ci = c;
                    gpu->memory = p->memory_mb << 20;
                    snprintf(gpu->name, sizeof gpu->name, "%.60s MIG %s", m->name, p->name);
                }
            }
        }
        if (found) cfg->gpus[kept++] = *gpu;
    }
    fake_state_unlock(st);
    cfg->count = kept;
}

int fake_mig_set_mode(struct fake_state *st, int slot, unsigned mode, int *activation) {
    if (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_INVALID_ARGUMENT;
    fake_state_lock(st);
    struct fake_mig_gpu *m = &st->mig[slot];
    int rc = NVML_SUCCESS;
    int any = 0;
    for (int g = 0; g < FAKE_MAX_GIS; g++) any |= (int)m->gis[g].live;
    if (mode == NVML_DEVICE_MIG_DISABLE && any) {
        rc = NVML_ERROR_IN_USE; /* its instances must be destroyed first */
    } else {
        /* The mode is pending until the GPU can be reset, which it can only while no process uses it. */
        m->pending = mode;
        *activation = fake_state_busy_locked(st, slot, -1, -1) ? NVML_ERROR_IN_USE : NVML_SUCCESS;
        if (*activation == NVML_SUCCESS) m->current = mode;
    }
    fake_state_unlock(st);
    return rc;
}

int fake_mig_create_gi(struct fake_state *st, int slot, const struct fake_gpu *gpu, unsigned profile_id, int start,
                       unsigned *gi_id) {
    const struct fake_mig_model *model = fake_mig_model_of(gpu);
    const struct fake_gi_profile *p = fake_mig_profile_by_id(model, profile_id);
    if (p == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    fake_state_lock(st);
    struct fake_mig_gpu *m = &st->mig[slot];
    int rc = m->current != NVML_DEVICE_MIG_ENABLE ? NVML_ERROR_NOT_SUPPORTED : place_gi(m, model, p, start, gi_id);
    fake_state_unlock(st);
    return rc;
}

int fake_mig_destroy_gi(struct fake_state *st, int slot, unsigned gi_id) {
    fake_state_lock(st);
    struct fake_mig_gi *gi = &st->mig[slot].gis[gi_id];
    int rc = NVML_SUCCESS;
    if (!gi->live) rc = NVML_ERROR_INVALID_ARGUMENT;
    for (int c = 0; rc == NVML_SUCCESS && c < FAKE_MAX_CIS; c++) {
        if (gi->cis[c].live) rc = NVML_ERROR_IN_USE; /* its compute instances go first */
    }
    if (rc == NVML_SUCCESS) memset(gi, 0, sizeof *gi);
    fake_state_unlock(st);
    return rc;
}

int fake_mig_create_ci(struct fake_state *st, int slot, unsigned gi_id, unsigned ci_profile, unsigned *ci_id) {
    fake_state_lock(st);
    struct fake_mig_gpu *m = &st->mig[slot];
    struct fake_mig_gi *gi = &m->gis[gi_id];
    const struct fake_mig_model *model = fake_mig_model_at(m->model);
    int rc = !gi->live || model == NULL ? NVML_ERROR_INVALID_ARGUMENT
                                        : place_ci(gi, model->profiles[gi->profile].slices, ci_profile, ci_id);
    fake_state_unlock(st);
    return rc;
}

int fake_mig_destroy_ci(struct fake_state *st, int slot, unsigned gi_id, unsigned ci_id) {
    fake_state_lock(st);
    struct fake_mig_ci *ci = &st->mig[slot].gis[gi_id].cis[ci_id];
    int rc = NVML_SUCCESS;
    if (!ci->live) rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (fake_state_busy_locked(st, slot, (int)gi_id, (int)ci_id)) rc = NVML_ERROR_IN_USE;
    else memset(ci, 0, sizeof *ci);
    fake_state_unlock(st);
    return rc;
}
