"""The exception tree of hamipy.devcluster.

    RuntimeError
     └── DevClusterError          something about the local control plane went wrong
          ├── BinaryBuildError    the binaries could not be found or built (proxy, Go, version)
          ├── ImageBuildError     a container image could not be made (a missing tool, file or package)
          ├── StartupError        a process exited or never became healthy; carries its log tail
          ├── ClusterStateError   `up` while already up, `down` with nothing up, stale state
          └── WaitTimeout         a wait helper's condition did not hold before its deadline

Callers that only want "the cluster is unusable" catch ``DevClusterError``.
"""

from __future__ import annotations


class DevClusterError(RuntimeError):
    """Base class of every error this package raises."""


class BinaryBuildError(DevClusterError):
    """The control-plane binaries could not be found or built; the message says why."""


class ImageBuildError(DevClusterError):
    """A container image of the dev cluster could not be made; the message names what is missing."""


class StartupError(DevClusterError):
    """A control-plane process died or did not become healthy in time.

    ``process`` names it (``"kube-apiserver"``), ``log_tail`` holds the last lines of its log.
    """

    def __init__(self, process: str, reason: str, log_tail: str = "") -> None:
        self.process = process
        self.reason = reason
        self.log_tail = log_tail
        message = f"{process}: {reason}"
        if log_tail:
            message += f"\n--- last lines of the {process} log ---\n{log_tail}"
        super().__init__(message)


class ClusterStateError(DevClusterError):
    """The `up`/`down` state on disk does not allow the requested action."""


class WaitTimeout(DevClusterError, TimeoutError):
    """A condition did not become true in time; the message says what was awaited and what was last seen."""
