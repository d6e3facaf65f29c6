"""Benchmark: in-process admission of a typical GPU pod (target p99 <= 5 ms).

Run as a script: ``.venv/bin/python tests/bench/bench_webhook.py [--iterations N]``. It times
``Admitter.admit`` on the raw AdmissionReview body (JSON decode, admission span, the pure decision,
JSONPatch + base64 encode, metrics and the JSON log line, written to /dev/null), and the pure
``mutation.decide`` alone, for a realistic pod as the apiserver sends it (defaults filled in).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _results import percentiles_us, record, time_calls

from hamipy.webhook.admitting import Admitter
from hamipy.webhook.mutation import MutationSettings, decide
from hamipy.webhook.telemetry import Telemetry

TARGET_P99_US = 5000.0


def container(name: str, limits: dict[str, str], *, env: int = 6) -> dict[str, Any]:
    return {
        "name": name,
        "image": f"registry.example.com/ml/{name}:2025.06",
        "command": ["python", "-m", "serve"],
        "args": ["--port", "8080", "--model", "/models/llama"],
        "env": [{"name": f"VAR_{i}", "value": f"value-{i}"} for i in range(env)],
        "ports": [{"containerPort": 8080, "protocol": "TCP", "name": "http"}],
        "resources": {"limits": limits, "requests": {**limits, "cpu": "2", "memory": "8Gi"}},
        "volumeMounts": [
            {"name": "models", "mountPath": "/models", "readOnly": True},
            {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5},
    }


def typical_gpu_pod() -> dict[str, Any]:
    """An inference pod: one GPU container (memory + cores + priority), one sidecar, one init container."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "llama-serve-6d9f7b8c5-",
            "namespace": "inference",
            "labels": {"app": "llama-serve", "pod-template-hash": "6d9f7b8c5"},
            "annotations": {"prometheus.io/scrape": "true", "nvidia.com/use-gputype": "A100"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "llama-serve-6d9f7b8c5",
                    "uid": "d9607e19-f88f-11e6-a518-42010a800195",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "initContainers": [container("fetch-model", {"cpu": "1"}, env=2)],
            "containers": [
                container(
                    "llama",
                    {
                        "cpu": "4",
                        "memory": "16Gi",
                        "nvidia.com/gpumem": "20000",
                        "nvidia.com/gpucores": "50",
                        "nvidia.com/priority": "0",
                    },
                ),
                container("metrics-sidecar", {"cpu": "100m", "memory": "64Mi"}, env=2),
            ],
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                {
                    "name": "kube-api-access-abcde",
                    "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]},
                },
            ],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "schedulerName": "default-scheduler",
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
            ],
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


def review_body(pod: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "inference",
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                "object": pod,
                "oldObject": None,
                "dryRun": False,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
            },
        }
    ).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=20_000)
    args = parser.parse_args()

    settings = MutationSettings(overwrite_env=True)
    pod = typical_gpu_pod()
    body = review_body(pod)
    with open(os.devnull, "w") as devnull:
        admitter = Admitter(settings, Telemetry.create(stream=devnull))
        answer = admitter.admit(body)
        assert answer.status == 200
        assert answer.decision is not None
        assert answer.decision.outcome == "mutated", answer.decision
        admit = percentiles_us(time_calls(lambda: admitter.admit(body), iterations=args.iterations))
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        pure = percentiles_us(
            time_calls(lambda: decide(pod, settings, trace_context=trace), iterations=args.iterations)
        )
        admitter.telemetry.shutdown()

    record(
        "webhook_admission",
        {
            "iterations": args.iterations,
            "body_bytes": len(body),
            "patch_ops": len(answer.decision.patch),
            "admit_in_process": admit,
            "decide_only": pure,
            "target_p99_us": TARGET_P99_US,
            "met": admit["p99_us"] <= TARGET_P99_US,
        },
    )


if __name__ == "__main__":
    main()
