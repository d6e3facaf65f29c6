/* The fake driver's shared pieces: its configuration file and the cross-process state file.
 *
 * Configuration (HAMIPY_FAKE_GPU_CONFIG names the file; without it, one 16 GiB GPU):
 *
 *   # comment
 *   driver_version = 550.54.15        # nvmlSystemGetDriverVersion
 *   cuda_version = 12040              # cuDriverGetVersion, nvmlSystemGetCudaDriverVersion
 *   context_memory = 0                # bytes each context takes on its device (k/m/g suffix)
 *   state = /tmp/fake-gpus.state      # shared state file (default: the config path + ".state")
 *   gpu uuid=GPU-... name="NVIDIA A100-SXM4-80GB" memory=80g numa=0 pci=00000000:3B:00.0 healthy=true xid=79
 *
 * One `gpu` line per GPU, in NVML index order; every key is optional. healthy=false makes NVML
 * deliver one XID critical-error event (eventData = xid, default 79) per event set that watches
 * the GPU; the file is re-read while an event set waits, so a test can flip it at run time. */
#ifndef HAMIPY_FAKE_H
#define HAMIPY_FAKE_H

#include <pthread.h>
#include <stdint.h>

#define FAKE_MAX_GPUS 16
#define FAKE_MAX_PROCS 256

struct fake_gpu {
    char uuid[96];
    char name[96];
    uint64_t memory;
    int numa;
    char pci[32];
    int healthy;
    unsigned xid;
};

struct fake_config {
    int count;
    struct fake_gpu gpus[FAKE_MAX_GPUS];
    char driver_version[80];
    int cuda_version;
    uint64_t context_memory;
    char path[4096];
    char state_path[4096];
};

/* Loads the configuration; on an error prints it on stderr and returns -1. */
int fake_config_load(struct fake_config *cfg);
int fake_parse_bytes(const char *text, uint64_t *out);
int fake_parse_uuid(const char *text, unsigned char out[16]);

/* Shared state: per process and device, the bytes the fake driver has handed out. */
struct fake_state {
    uint32_t magic;
    uint32_t pad;
    pthread_mutex_t mu; /* process-shared, robust */
    struct {
        int32_t pid;
        uint64_t start;
        uint64_t used[FAKE_MAX_GPUS];
    } procs[FAKE_MAX_PROCS];
};

/* Maps the state file; claim = 1 also takes this process's entry (the CUDA side does). */
struct fake_state *fake_state_attach(const struct fake_config *cfg, int claim);
/* Adds bytes to this process on dev unless the device would pass `physical`; 0 or -1. */
int fake_state_charge(struct fake_state *st, int dev, uint64_t bytes, uint64_t physical);
void fake_state_uncharge(struct fake_state *st, int dev, uint64_t bytes);
/* Gives back everything this process holds (at exit). */
void fake_state_leave(struct fake_state *st);
uint64_t fake_state_used(struct fake_state *st, int dev);
/* Live processes using dev: fills up to max entries, returns how many there are. */
unsigned fake_state_procs(struct fake_state *st, int dev, unsigned max, unsigned *pids, uint64_t *used);

#endif
