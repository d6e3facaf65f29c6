/* The fake NVML's topology queries answer as real NVML does: INVALID_ARGUMENT for a link past
 * NVML_NVLINK_MAX_LINKS, a link past the GPU's own, a NULL output or a bad handle; NOT_SUPPORTED
 * on a GPU without NVLink and for the remote end of a disabled link; a P2P level that is the same
 * both ways. Prints what it read, for the caller to compare with the configuration:
 *   link <gpu> <link> <enabled> <remote type> <remote bus id>
 *   p2p <gpu> <gpu> <level>
 * and `nvlink <gpu> none` for a GPU without NVLink. */
#include <string.h>

#include "common.h"
#include "nvml_types.h"

static void check_links(unsigned gpu, nvmlDevice_t dev) {
    nvmlEnableState_t state = NVML_FEATURE_DISABLED;
    nvmlPciInfo_t pci;
    nvmlIntNvLinkDeviceType_t type = NVML_NVLINK_DEVICE_TYPE_UNKNOWN;
    CHECK_RC(nvmlDeviceGetNvLinkState(dev, NVML_NVLINK_MAX_LINKS, &state), NVML_ERROR_INVALID_ARGUMENT);
    CHECK_RC(nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, NVML_NVLINK_MAX_LINKS, &pci), NVML_ERROR_INVALID_ARGUMENT);
    CHECK_RC(nvmlDeviceGetNvLinkRemoteDeviceType(dev, NVML_NVLINK_MAX_LINKS, &type), NVML_ERROR_INVALID_ARGUMENT);
    CHECK_RC(nvmlDeviceGetNvLinkState(dev, 0, NULL), NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t first = nvmlDeviceGetNvLinkState(dev, 0, &state);
    if (first == NVML_ERROR_NOT_SUPPORTED) {
        CHECK_RC(nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, 0, &pci), NVML_ERROR_NOT_SUPPORTED);
        CHECK_RC(nvmlDeviceGetNvLinkRemoteDeviceType(dev, 0, &type), NVML_ERROR_NOT_SUPPORTED);
        printf("nvlink %u none\n", gpu);
        return;
    }
    CHECK_RC(first, NVML_SUCCESS);
    unsigned link = 0;
    for (; link < NVML_NVLINK_MAX_LINKS; link++) {
        nvmlReturn_t rc = nvmlDeviceGetNvLinkState(dev, link, &state);
        if (rc == NVML_ERROR_INVALID_ARGUMENT) break; /* past this GPU's links: so are the rest */
        CHECK_RC(rc, NVML_SUCCESS);
        if (state == NVML_FEATURE_DISABLED) {
            CHECK_RC(nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, link, &pci), NVML_ERROR_NOT_SUPPORTED);
            CHECK_RC(nvmlDeviceGetNvLinkRemoteDeviceType(dev, link, &type), NVML_ERROR_NOT_SUPPORTED);
            printf("link %u %u 0 - -\n", gpu, link);
            continue;
        }
        CHECK(state == NVML_FEATURE_ENABLED);
        CHECK_RC(nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, link, &pci), NVML_SUCCESS);
        CHECK_RC(nvmlDeviceGetNvLinkRemoteDeviceType(dev, link, &type), NVML_SUCCESS);
        CHECK(type == NVML_NVLINK_DEVICE_TYPE_GPU || type == NVML_NVLINK_DEVICE_TYPE_SWITCH);
        printf("link %u %u 1 %s %s\n", gpu, link, type == NVML_NVLINK_DEVICE_TYPE_SWITCH ? "switch" : "gpu",
               pci.busId);
    }
    for (; link < NVML_NVLINK_MAX_LINKS; link++) {
        CHECK_RC(nvmlDeviceGetNvLinkState(dev, link, &state), NVML_ERROR_INVALID_ARGUMENT);
        CHECK_RC(nvmlDeviceGetNvLinkRemotePciInfo_v2(dev, link, &pci), NVML_ERROR_INVALID_ARGUMENT);
    }
}

int main(void) {
    CHECK_RC(nvmlInit_v2(), NVML_SUCCESS);
    unsigned count = 0;
    CHECK_RC(nvmlDeviceGetCount_v2(&count), NVML_SUCCESS);
    nvmlDevice_t devs[64];
    CHECK(count <= 64);
    for (unsigned i = 0; i < count; i++) CHECK_RC(nvmlDeviceGetHandleByIndex_v2(i, &devs[i]), NVML_SUCCESS);
    nvmlGpuTopologyLevel_t level = NVML_TOPOLOGY_INTERNAL, back = NVML_TOPOLOGY_INTERNAL;
    int bogus = 0;
    CHECK_RC(nvmlDeviceGetTopologyCommonAncestor(devs[0], (nvmlDevice_t)&bogus, &level), NVML_ERROR_INVALID_ARGUMENT);
    CHECK_RC(nvmlDeviceGetTopologyCommonAncestor(devs[0], devs[0], NULL), NVML_ERROR_INVALID_ARGUMENT);
    nvmlEnableState_t state;
    CHECK_RC(nvmlDeviceGetNvLinkState((nvmlDevice_t)&bogus, 0, &state), NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned i = 0; i < count; i++) {
        check_links(i, devs[i]);
        for (unsigned j = 0; j < count; j++) {
            if (i == j) continue;
            CHECK_RC(nvmlDeviceGetTopologyCommonAncestor(devs[i], devs[j], &level), NVML_SUCCESS);
            CHECK_RC(nvmlDeviceGetTopologyCommonAncestor(devs[j], devs[i], &back), NVML_SUCCESS);
            CHECK_EQ(level, back);
            printf("p2p %u %u %d\n", i, j, (int)level);
        }
    }
    CHECK_RC(nvmlShutdown(), NVML_SUCCESS);
    return 0;
}
