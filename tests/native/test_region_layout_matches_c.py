"""The C header and the Python mirror of the shared region cannot drift.

A small C program compiled against native/include/hamipy/region.h prints every offset and size
the interposer uses; each must equal the constant hamipy.protocol.region reads at. (HAMi and
HAMi-core drifted exactly here; STYLE.md.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hamipy.protocol import region

pytestmark = pytest.mark.native

HEADER_DIR = Path(__file__).resolve().parents[2] / "native" / "include"


def _r(field: str) -> str:
    return f"offsetof(struct hami_region, {field})"


# (name in the dump, C expression, Python constant)
FIELDS: list[tuple[str, str, int]] = [
    ("initialized_flag", "offsetof(struct hami_region, initialized_flag)", region.OFFSET_INITIALIZED_FLAG),
    ("major_version", "offsetof(struct hami_region, major_version)", region.OFFSET_MAJOR_VERSION),
    ("minor_version", "offsetof(struct hami_region, minor_version)", region.OFFSET_MINOR_VERSION),
    ("sm_init_flag", "offsetof(struct hami_region, sm_init_flag)", region.OFFSET_SM_INIT_FLAG),
    ("owner_pid", "offsetof(struct hami_region, owner_pid)", region.OFFSET_OWNER_PID),
    ("sem", "offsetof(struct hami_region, sem)", region.OFFSET_SEM),
    ("sem_size", "sizeof(sem_t)", region.SEM_T_SIZE),
    ("device_num", "offsetof(struct hami_region, device_num)", region.OFFSET_DEVICE_NUM),
    ("uuids", "offsetof(struct hami_region, uuids)", region.OFFSET_UUIDS),
    ("uuid_size", "HAMI_UUID_LEN", region.UUID_SIZE),
    ("limit", "offsetof(struct hami_region, limit)", region.OFFSET_LIMIT),
    ("sm_limit", "offsetof(struct hami_region, sm_limit)", region.OFFSET_SM_LIMIT),
    ("procs", "offsetof(struct hami_region, procs)", region.OFFSET_PROCS),
    ("proc_num", "offsetof(struct hami_region, proc_num)", region.OFFSET_PROC_NUM),
    (
        "utilization_switch",
        "offsetof(struct hami_region, utilization_switch)",
        region.OFFSET_UTILIZATION_SWITCH,
    ),
    ("recent_kernel", "offsetof(struct hami_region, recent_kernel)", region.OFFSET_RECENT_KERNEL),
    ("priority", "offsetof(struct hami_region, priority)", region.OFFSET_PRIORITY),
    ("last_kernel_time", "offsetof(struct hami_region, last_kernel_time)", region.OFFSET_LAST_KERNEL_TIME),
    ("sem_postinit", "offsetof(struct hami_region, sem_postinit)", region.OFFSET_SEM_POSTINIT),
    ("region_size", "sizeof(struct hami_region)", region.REGION_STRUCT_SIZE),
    ("file_size", "HAMI_REGION_FILE_SIZE", region.REGION_FILE_SIZE),
    ("magic", "HAMI_REGION_MAGIC", region.MAGIC),
    ("major", "HAMI_REGION_MAJOR", region.MAJOR_VERSION),
    ("minor", "HAMI_REGION_MINOR", region.MINOR_VERSION),
    ("max_devices", "HAMI_MAX_DEVICES", region.MAX_DEVICES),
    ("max_procs", "HAMI_MAX_PROCS", region.MAX_PROCS),
    ("slot_size", "sizeof(struct hami_proc_slot)", region.PROC_SLOT_SIZE),
    ("slot_pid", "offsetof(struct hami_proc_slot, pid)", region.PROC_PID),
    ("slot_hostpid", "offsetof(struct hami_proc_slot, hostpid)", region.PROC_HOSTPID),
    ("slot_used", "offsetof(struct hami_proc_slot, used)", region.PROC_USED),
    ("slot_monitorused", "offsetof(struct hami_proc_slot, monitorused)", region.PROC_MONITORUSED),
    ("slot_device_util", "offsetof(struct hami_proc_slot, device_util)", region.PROC_DEVICE_UTIL),
    ("slot_status", "offsetof(struct hami_proc_slot, status)", region.PROC_STATUS),
    ("slot_seqlock", "offsetof(struct hami_proc_slot, seqlock)", region.PROC_SEQLOCK),
    ("slot_unused", "offsetof(struct hami_proc_slot, unused)", region.PROC_UNUSED),
    ("used_size", "sizeof(struct hami_device_memory)", region.USED_ENTRY_SIZE),
    ("used_context", "offsetof(struct hami_device_memory, context_size)", region.USED_CONTEXT_SIZE),
    ("used_module", "offsetof(struct hami_device_memory, module_size)", region.USED_MODULE_SIZE),
    ("used_data", "offsetof(struct hami_device_memory, data_size)", region.USED_DATA_SIZE),
    ("used_offset", "offsetof(struct hami_device_memory, offset)", region.USED_OFFSET),
    ("used_total", "offsetof(struct hami_device_memory, total)", region.USED_TOTAL),
    ("util_size", "sizeof(struct hami_device_util)", region.UTIL_ENTRY_SIZE),
    ("util_dec", "offsetof(struct hami_device_util, dec_util)", region.UTIL_DEC_UTIL),
    ("util_enc", "offsetof(struct hami_device_util, enc_util)", region.UTIL_ENC_UTIL),
    ("util_sm", "offsetof(struct hami_device_util, sm_util)", region.UTIL_SM_UTIL),
]


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is required to check the C layout"
    work = tmp_path_factory.mktemp("layout")
    lines = ["#include <stdio.h>", '#include "hamipy/region.h"', "int main(void) {", '  printf("{");']
    for i, (name, expr, _) in enumerate(FIELDS):
        sep = "," if i else ""
        lines.append(f'  printf("{sep}\\"{name}\\": %llu", (unsigned long long)({expr}));')
    lines += ['  printf("}\\n");', "  return 0;", "}"]
    src = work / "dump.c"
    src.write_text("\n".join(lines) + "\n")
    exe = work / "dump"
    subprocess.run(
        [gcc, "-std=gnu11", "-Wall", "-Werror", f"-I{HEADER_DIR}", str(src), "-o", str(exe)],
        check=True,
        timeout=120,
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=30)
    layout: dict[str, int] = json.loads(out.stdout)
    return layout


@pytest.mark.parametrize(
    ("name", "python_value"), [(n, v) for n, _, v in FIELDS], ids=[n for n, _, _ in FIELDS]
)
def test_c_header_matches_python_mirror(c_layout: dict[str, int], name: str, python_value: int) -> None:
    assert c_layout[name] == python_value
