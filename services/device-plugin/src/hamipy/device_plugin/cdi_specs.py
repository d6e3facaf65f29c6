"""The CDI spec file of one container's slot, written before a ``cdi-cri`` Allocate is answered
(docs/device-plugin.md#cdi).

The spec (``hamipy.protocol.cdi.slot_spec``) goes into the runtime's CDI spec directory under its
own name (``spec_file_name``), whole: a new file of mode 0644, under a name the CDI library does
not read (it reads ``*.json`` and ``*.yaml`` only), renamed over the old one. The runtime, which
watches the directory, so sees either the previous spec or the new one, never half of one. The
monitor removes the files of pods that are gone (``hamipy.monitor.cdi_specs``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Final

from hamipy.protocol.allocation_env import ContainerAllocation
from hamipy.protocol.cdi import encode_spec, slot_spec, spec_file_name

__all__ = ["SPEC_FILE_MODE", "write_slot_spec"]

SPEC_FILE_MODE: Final = 0o644
"""Readable by the runtime whatever user it runs as; written by the plugin alone."""


def write_slot_spec(spec_dir: Path, allocation: ContainerAllocation, *, pod_uid: str, container: str) -> Path:
    """Write the spec of the slot ``allocation`` answers for; its path."""
    spec = slot_spec(allocation, pod_uid=pod_uid, container_name=container)
    path = spec_dir / spec_file_name(pod_uid, container)
    spec_dir.mkdir(parents=True, exist_ok=True)
    staged = spec_dir / f".{path.name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, SPEC_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), SPEC_FILE_MODE)  # whatever the umask took away
            file.write(encode_spec(spec))
        staged.replace(path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return path
