/* The fake driver's shared pieces: its configuration file and the cross-process state file.
 *
 * Configuration (HAMIPY_FAKE_GPU_CONFIG names the file, or a directory whose files, names starting
 * with '.' left out, are read in byte order of their names as one file; without it,
 * FAKE_INSTALLED_CONFIG if it exists, where the dev cluster's runtime installs a GPU container's,
 * so that a process `kubectl exec` starts sees the container's GPUs; else one 16 GiB GPU):
 *
 *   # comment
 *   driver_version = 550.54.15        # nvmlSystemGetDriverVersion
 *   cuda_version = 12040              # cuDriverGetVersion, nvmlSystemGetCudaDriverVersion
 *   context_memory = 0                # bytes each context takes on its device (k/m/g suffix)
 *   state = /tmp/fake-gpus.state      # shared state file (default: the config path + ".state")
 *   kilothread_ns = 0                 # GPU time of a kernel launch per 1024 threads (grid x block)
 *   graph_ns = 0                      # GPU time of one cuGraphLaunch
 *   launch_queue_ms = 10              # a launch blocks while more work than this is queued before it
 *   util_sample_ms = 100              # period of NVML's per-process utilization samples
 *   host_pid_offset = 0               # NVML reports pid + this (a container's pids are not the host's)
 *   gpu uuid=GPU-... name="NVIDIA A100-SXM4-80GB" memory=80g numa=0 pci=00000000:3B:00.0 healthy=true xid=79
 *   topology = hgx8                   # a preset of links and P2P levels: hgx8 | pcie-pairs8 | none
 *   p2p_level = NODE                  # P2P level of every pair (default: NODE on one NUMA node, else SYS)
 *   p2p 0 1 = PIX                     # the level of one pair of GPUs (NVML indexes), both ways
 *
 * Kernels (compute for the limiter's tests). Each process has one stream per fake GPU: a launch
 * queues its GPU time (kilothread_ns x threads / 1024, or graph_ns) after the work already queued,
 * blocking first while more than launch_queue_ms is queued (the driver's queue is finite).
 * Processes do not contend: each has the fake GPU's time to itself. The executed GPU time of
 * every process is kept in the shared state; NVML's nvmlDeviceGetProcessUtilization turns it
 * into per-process samples (percent of each util_sample_ms period, whole percents, CPU
 * timestamps in microseconds), taken when it is called. Kernels take no time by default.
 * Launches into a stream being captured (cuStreamBeginCapture_v2) take no time either; modules
 * (cuModuleLoadData) accept any image and hold one dummy function; cuGraphLaunch accepts any
 * non-NULL exec handle, and cuGraphInstantiateWithFlags turns any captured graph into one.
 * cuDeviceGetAttribute answers the multiprocessor count (108) and cooperative launch (1) only.
 * fakecuda_executed_ns(dev) is this process's executed GPU time.
 *
 * One `gpu` line per GPU, in NVML index order; every key is optional. slot=N (default: the line's
 * position) is the GPU's index in the shared state: a container's configuration lists only the
 * GPUs it was given, each with the host's slot, so usage lands on the host's GPU (a container
 * given GPUs by CDI gets a directory holding one file per GPU, as a real driver reaches one device
 * node per GPU). healthy=false makes NVML deliver one XID critical-error event (eventData = xid,
 * default 79) per event set that watches the GPU; the configuration is re-read while an event set
 * waits, so a test can flip it at run time.
 *
 * Topology (nvmlDeviceGetTopologyCommonAncestor and the NVLink queries). A gpu line's
 * nvlinks=<end>,<end>,... lists its NVLinks in link order; an end is the remote GPU's PCI bus id,
 * `nvswitch` (NVSwitch k = link % 4, bus id 00000000:E<k>:00.0) or `off` (a disabled link), and
 * `<end>*N` repeats it N times; at most NVML_NVLINK_MAX_LINKS (18). A GPU without nvlinks has no
 * NVLink (its link queries answer NOT_SUPPORTED). A P2P level is INTERNAL, PIX, PXB, PHB, NODE,
 * SYS or NVML's number. `topology` fills what the GPU lines and p2p lines leave unset, after every
 * file is read: hgx8 gives every GPU 18 links into the NVSwitches; pcie-pairs8 joins GPUs 2k and
 * 2k+1 with 12 links (three NVLink bridges) and gives each such pair PIX; none adds nothing. A
 * preset with no gpu line makes 8 GPUs (H100 80GB, A100 80GB PCIe, L40S), 0-3 on NUMA node 0 and
 * 4-7 on node 1.
 *
 * MIG (mig.c; docs/isolation.md#the-fake-driver). Names holding A100 (40/80 GB), H100 (80 GB) or
 * H200 (141 GB) are MIG-capable, with the driver's profile ids, placements and NVIDIA's NVML-mock
 * sizes; elsewhere MIG calls answer NOT_SUPPORTED. mig=on|off (default off) is the MIG mode and
 * mig_instances=<profile>@<start>,... the GPU instances (each with one full compute instance) made
 * when the state file is created. MIG mode, GPU and compute instances live in the shared state;
 * each compute instance is a MIG device with a new random MIG- UUID. `gpu uuid=MIG-...` is
 * resolved through the state to that instance, which sets its slot (the parent's), memory (the
 * instance's) and name ("<parent> MIG <profile>"); its allocations are charged to the instance too
 * (procs[].gi_used), so it runs out at the instance's size. An unknown MIG UUID drops the line. The
 * fake libcuda reads CUDA_VISIBLE_DEVICES (indexes, GPU- and MIG- UUIDs) as the real driver does. */
#ifndef HAMIPY_FAKE_H
#define HAMIPY_FAKE_H

#include <pthread.h>
#include <stdint.h>

#define FAKE_INSTALLED_CONFIG "/etc/hamipy-fake-gpu/gpus.conf"
#define FAKE_MAX_GPUS 16
#define FAKE_MAX_PROCS 256
#define FAKE_MAX_NVLINKS 18 /* NVML_NVLINK_MAX_LINKS */
#define FAKE_NVSWITCHES 4
#define FAKE_MAX_GIS 8      /* GPU instance ids 0..7 (at most 7 instances live) */
#define FAKE_MAX_CIS 8      /* compute instance ids 0..7 within a GPU instance */
#define FAKE_MIG_UUID_LEN 48

enum fake_link_end { FAKE_LINK_OFF, FAKE_LINK_GPU, FAKE_LINK_SWITCH };

struct fake_link {
    enum fake_link_end end;
    char remote[32]; /* the remote PCI bus id (a GPU's or an NVSwitch's) */
};

enum fake_topology { FAKE_TOPOLOGY_UNSET, FAKE_TOPOLOGY_NONE, FAKE_TOPOLOGY_HGX8, FAKE_TOPOLOGY_PCIE_PAIRS8 };

struct fake_gpu {
    char uuid[96];
    char name[96];
    uint64_t memory;
    int numa;
    char pci[32];
    int healthy;
    unsigned xid;
    int slot; /* its index in the shared state: the host's index when a container sees a subset */
    int nvlinks; /* links in `links`; -1: no nvlinks key (no NVLink unless the preset gives some) */
    struct fake_link links[FAKE_MAX_NVLINKS];
    int mig;                   /* mig=on: MIG mode when the state file is created */
    char mig_instances[256];   /* mig_instances=<profile>@<start>,...: instances made then */
    int gi, ci;                /* a `uuid=MIG-...` line resolved: its instance on `slot`; -1 otherwise */
};

struct fake_config {
    int count;
    struct fake_gpu gpus[FAKE_MAX_GPUS];
    char driver_version[80];
    int cuda_version;
    uint64_t context_memory;
    double kilothread_ns;
    uint64_t graph_ns;
    uint64_t launch_queue_ns;
    uint64_t util_sample_ns;
    unsigned host_pid_offset;
    enum fake_topology topology;
    int p2p_level; /* -1: NODE on one NUMA node, else SYS */
    int p2p[FAKE_MAX_GPUS][FAKE_MAX_GPUS]; /* per pair, -1 = p2p_level */
    char path[4096];
    char state_path[4096];
};

/* Loads the configuration; on an error prints it on stderr and returns -1. */
int fake_config_load(struct fake_config *cfg);
int fake_parse_bytes(const char *text, uint64_t *out);
int fake_parse_uuid(const char *text, unsigned char out[16]);
/* The P2P level (nvmlGpuTopologyLevel_t) between two configured GPUs, by NVML index. */
int fake_p2p_level(const struct fake_config *cfg, int a, int b);

/* MIG state of one GPU (slot), shared by every process. */
struct fake_mig_ci {
    uint32_t live, profile, start, size; /* profile: NVML_COMPUTE_INSTANCE_PROFILE_*; slices in the GI */
    char uuid[FAKE_MIG_UUID_LEN];       /* the MIG device's UUID, new at each creation */
};

struct fake_mig_gi {
    uint32_t live, profile; /* profile: index in the model's table (fake_mig_model) */
    uint32_t start, size;   /* memory-slice placement */
    struct fake_mig_ci cis[FAKE_MAX_CIS];
};

struct fake_mig_gpu {
    uint32_t current, pending; /* NVML_DEVICE_MIG_DISABLE / _ENABLE */
    uint32_t model;            /* 1 + index of the model table, 0 = not MIG-capable */
    char name[96];             /* the parent's name, for a container that knows only a MIG UUID */
    char uuid[96];
    struct fake_mig_gi gis[FAKE_MAX_GIS];
};

/* Shared state: per process and device, the bytes the fake driver has handed out. */
struct fake_state {
    uint32_t magic;
    uint32_t pad;
    pthread_mutex_t mu; /* process-shared, robust */
    struct {
        int32_t pid;   /* in the process's own PID namespace */
        uint64_t start;
        uint64_t pidns; /* inode of that namespace (/proc/<pid>/ns/pid): a container's is not the host's */
        uint64_t used[FAKE_MAX_GPUS];
        uint64_t queued_ns[FAKE_MAX_GPUS]; /* GPU time of all launches so far */
        uint64_t until_ns[FAKE_MAX_GPUS];  /* CLOCK_MONOTONIC time the last one finishes */
        uint64_t gi_used[FAKE_MAX_GPUS][FAKE_MAX_GIS]; /* the part of used[] on a MIG instance */
        uint8_t gi_ci[FAKE_MAX_GPUS][FAKE_MAX_GIS];    /* the compute instance that use runs on */
    } procs[FAKE_MAX_PROCS];
    struct fake_mig_gpu mig[FAKE_MAX_GPUS];
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
/* Queues ns of GPU time for this process on dev, unless more than queue_ns is queued already:
 * then returns how long to wait before trying again (0 = queued). */
uint64_t fake_state_launch(struct fake_state *st, int dev, uint64_t ns, uint64_t queue_ns);
/* GPU time this process's launches on dev have executed by now. */
uint64_t fake_state_executed(struct fake_state *st, int dev);
/* Live processes that launched on dev and the GPU time each has executed by now. */
unsigned fake_state_executed_all(struct fake_state *st, int dev, unsigned max, unsigned *pids, uint64_t *executed);
/* CLOCK_MONOTONIC in ns, the clock of until_ns. */
uint64_t fake_now_ns(void);
/* Live processes with memory on a slot (gi < 0: anywhere on it; else on that GPU instance, and
 * ci >= 0: on that compute instance): pids, bytes and the GI/CI each runs on (~0u: none). */
unsigned fake_state_procs_at(struct fake_state *st, int slot, int gi, int ci, unsigned max, unsigned *pids,
                             uint64_t *used, unsigned *gis, unsigned *cis);
void fake_state_lock(struct fake_state *st);
void fake_state_unlock(struct fake_state *st);
/* Whether a live process holds memory on the slot (gi/ci as for fake_state_procs_at); lock held. */
int fake_state_busy_locked(struct fake_state *st, int slot, int gi, int ci);

/* ---- MIG (mig.c): the models' GPU-instance profiles and the instances in the shared state */

struct fake_gi_profile {
    unsigned index;  /* NVML_GPU_INSTANCE_PROFILE_* */
    unsigned id;     /* nvmlGpuInstanceProfileInfo_t.id, what create/placement calls take */
    const char *name; /* "1g.5gb" */
    unsigned slices, instances, sms, copy_engines, decoders, encoders, jpegs, ofas;
    unsigned long long memory_mb;
    unsigned size;        /* memory slices of a placement */
    unsigned nstarts;
    unsigned starts[8];
};

struct fake_mig_model {
    const char *name; /* "A100 40GB" */
    unsigned nprofiles;
    const struct fake_gi_profile *profiles;
};

/* The MIG table of a configured GPU's model; NULL when it has no MIG. */
const struct fake_mig_model *fake_mig_model_of(const struct fake_gpu *gpu);
const struct fake_mig_model *fake_mig_model_at(uint32_t model); /* by fake_mig_gpu.model */
/* Checks a gpu line's mig keys; on an error writes why into err and returns -1. */
int fake_mig_check_config(const struct fake_gpu *gpu, char *err, size_t len);
/* At state creation: MIG mode and the instances of each configured GPU. */
void fake_mig_apply_config(struct fake_state *st, const struct fake_config *cfg);
/* Resolves `uuid=MIG-...` lines through the state (slot, memory, name); drops absent ones. */
void fake_mig_resolve(struct fake_config *cfg, struct fake_state *st);
/* A copy of a slot's MIG state. */
void fake_mig_snapshot(struct fake_state *st, int slot, struct fake_mig_gpu *out);
/* The operations: NVML return codes. */
int fake_mig_set_mode(struct fake_state *st, int slot, unsigned mode, int *activation);
int fake_mig_create_gi(struct fake_state *st, int slot, const struct fake_gpu *gpu, unsigned profile_id, int start,
                       unsigned *gi_id);
int fake_mig_destroy_gi(struct fake_state *st, int slot, unsigned gi);
int fake_mig_create_ci(struct fake_state *st, int slot, unsigned gi, unsigned ci_profile, unsigned *ci_id);
int fake_mig_destroy_ci(struct fake_state *st, int slot, unsigned gi, unsigned ci);
/* GPU instances of a profile id still creatable (placements free and count left). */
unsigned fake_mig_gi_capacity(const struct fake_mig_gpu *m, const struct fake_mig_model *model,
                              const struct fake_gi_profile *p);
const struct fake_gi_profile *fake_mig_profile_by_id(const struct fake_mig_model *model, unsigned id);
const struct fake_gi_profile *fake_mig_profile_by_index(const struct fake_mig_model *model, unsigned index);
/* Compute-instance profiles of a GPU instance of `slices` compute slices: the CI's slices, or 0 if
 * the profile (NVML_COMPUTE_INSTANCE_PROFILE_*) does not fit. */
unsigned fake_mig_ci_slices(unsigned gi_slices, unsigned ci_profile);
unsigned fake_mig_ci_capacity(const struct fake_mig_gi *gi, unsigned gi_slices, unsigned ci_profile);

#endif
