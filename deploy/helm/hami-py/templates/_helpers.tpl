{{/* Names, labels and images shared by the templates. */}}

{{/* Helm's usual naming: nameOverride replaces the chart's name in the object names,
fullnameOverride replaces the whole prefix. 50 characters leave room for "-<component>". The
app.kubernetes.io/name labels stay hamipy-<component>: they name the program (the webhook's certs
command writes the same label) and are part of immutable selectors. */}}
{{- define "hami-py.chartName" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "hami-py.fullname" -}}
{{- $name := include "hami-py.chartName" . -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "hami-py.name" -}}
{{- printf "%s-%s" (include "hami-py.fullname" .root) .component -}}
{{- end -}}

{{- define "hami-py.labels" -}}
app.kubernetes.io/name: hamipy-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/part-of: hami-py
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "hami-py.selector" -}}
app.kubernetes.io/name: hamipy-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "hami-py.image" -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .component (default .root.Chart.AppVersion .root.Values.image.tag) -}}
{{- end -}}

{{/* kube-scheduler's image. Its tag defaults to the cluster's own version, so the scheduler is
never skewed against the apiserver; only vMAJOR.MINOR.PATCH of it, since managed clusters report
versions such as v1.30.2-eks-1234 for which registry.k8s.io has no image. A string
scheduler.image (the chart's first form, "repository:tag") is used as it is. */}}
{{- define "hami-py.schedulerImage" -}}
{{- $image := .Values.scheduler.image -}}
{{- if kindIs "string" $image -}}
{{- $image -}}
{{- else -}}
{{- $tag := $image.tag -}}
{{- if not $tag -}}
{{- $version := regexFind `[0-9]+\.[0-9]+\.[0-9]+` .Capabilities.KubeVersion.Version -}}
{{- if not $version -}}
{{- fail (printf "cannot take kube-scheduler's tag from the cluster version %q: set scheduler.image.tag" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- $tag = printf "v%s" $version -}}
{{- end -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The webhook Service's DNS name, for certificates. */}}
{{- define "hami-py.webhookService" -}}
{{- include "hami-py.name" (dict "root" . "component" "webhook") -}}
{{- end -}}

{{/* Environment every service gets: the config file, tracing. */}}
{{- define "hami-py.commonEnv" -}}
- name: HAMIPY_CONFIG
  value: /etc/hami-py/config.yaml
{{- if .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- end -}}

{{/* A Service's ServiceMonitor for the Prometheus operator, when <service>.serviceMonitor.enabled.
honorLabels must be true where the series name tenants' pods (the extender's and the monitor's
namespace, pod and container labels): otherwise Prometheus gives every series the scraped pod's
target labels (namespace="hami-system", pod=<our pod>) and renames the real ones exported_*.
A DaemonSet's pod stands for its node: nodeLabel adds the node's name as `node` (kept from the
series where it has one). Arguments: root, component, values (the serviceMonitor values), port (the
Service's port name), honorLabels, nodeLabel, metricRelabelings (optional). */}}
{{- define "hami-py.serviceMonitor" -}}
{{- if .values.enabled }}
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "hami-py.name" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "hami-py.labels" . | nindent 4 }}
    {{- with .values.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "hami-py.selector" . | nindent 6 }}
      {{- with .serviceLabels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  endpoints:
    - port: {{ .port }}
      path: /metrics
      honorLabels: {{ .honorLabels }}
      {{- with .values.interval }}
      interval: {{ . }}
      {{- end }}
      {{- if .nodeLabel }}
      relabelings:
        - sourceLabels: [__meta_kubernetes_pod_node_name]
          targetLabel: node
      {{- end }}
      {{- with .metricRelabelings }}
      metricRelabelings:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "hami-py.configVolume" -}}
- name: config
  configMap:
    name: {{ include "hami-py.name" (dict "root" . "component" "config") }}
{{- end -}}

{{- define "hami-py.configMount" -}}
- name: config
  mountPath: /etc/hami-py
  readOnly: true
{{- end -}}

{{/* The host's CDI spec directory, under the cdi-cri strategy only: the device plugin writes each
slot's spec there, the monitor removes those of pods gone. Nothing otherwise. */}}
{{- define "hami-py.cdiVolume" -}}
{{- if eq .Values.config.nvidia.deviceListStrategy "cdi-cri" }}
- name: cdi-specs
  hostPath: {path: {{ .Values.config.nvidia.cdiSpecDir }}, type: DirectoryOrCreate}
{{- end }}
{{- end -}}

{{- define "hami-py.cdiMount" -}}
{{- if eq .Values.config.nvidia.deviceListStrategy "cdi-cri" }}
- {name: cdi-specs, mountPath: {{ .Values.config.nvidia.cdiSpecDir }}}
{{- end }}
{{- end -}}

{{/* CEL: the pod names one of our GPU resources in a container's or init container's limits or
requests. The same expression as hamipy.protocol.cel.gpu_pod_expression (a chart test
checks it). */}}
{{- define "hami-py.gpuPodExpression" -}}
{{- $n := .Values.config.nvidia -}}
{{- $wanted := printf "['%s', '%s', '%s', '%s']" $n.resourceCountName $n.resourceMemoryName $n.resourceMemoryPercentageName $n.resourceCoreName -}}
{{- $clause := printf "has(c.resources) && ((has(c.resources.limits) && %s.exists(r, r in c.resources.limits)) || (has(c.resources.requests) && %s.exists(r, r in c.resources.requests)))" $wanted $wanted -}}
{{- printf "object.spec.containers.exists(c, %s) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, %s))" $clause $clause -}}
{{- end -}}
