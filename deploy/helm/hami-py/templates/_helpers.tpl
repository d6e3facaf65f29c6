{{/* Names, labels and images shared by the templates. */}}

{{- define "hami-py.fullname" -}}
{{- if contains "hami-py" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-hami-py" .Release.Name | trunc 50 | trimSuffix "-" -}}
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

{{/* CEL: the pod names one of our GPU resources in a container's or init container's limits or
requests. The same expression as hamipy.webhook.registration.gpu_pod_expression (a chart test
checks it). */}}
{{- define "hami-py.gpuPodExpression" -}}
{{- $n := .Values.config.nvidia -}}
{{- $wanted := printf "['%s', '%s', '%s', '%s']" $n.resourceCountName $n.resourceMemoryName $n.resourceMemoryPercentageName $n.resourceCoreName -}}
{{- $clause := printf "has(c.resources) && ((has(c.resources.limits) && %s.exists(r, r in c.resources.limits)) || (has(c.resources.requests) && %s.exists(r, r in c.resources.requests)))" $wanted $wanted -}}
{{- printf "object.spec.containers.exists(c, %s) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, %s))" $clause $clause -}}
{{- end -}}
