{{/* Names and labels (the usual Helm conventions). */}}
{{- define "chattts.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chattts.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What selects the server pods: Deployment, Service, PDB, NetworkPolicy, anti-affinity. */}}
{{- define "chattts.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chattts.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end -}}

{{- define "chattts.labels" -}}
{{ include "chattts.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "chattts.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "chattts.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "chattts.resumeSecret" -}}
{{- default (printf "%s-resume" (include "chattts.fullname" .)) .Values.resumeSecret.existingSecret -}}
{{- end -}}

{{/* Whether resume tokens are signed: a shared secret was given. */}}
{{- define "chattts.resumeSigned" -}}
{{- if or .Values.resumeSecret.value .Values.resumeSecret.existingSecret -}}true{{- end -}}
{{- end -}}

{{/*
A flag's value as its CHATTTS_* variable. Helm reads every number of a values file as a
float: printed as it is, 268435456 would become "2.68435456e+08", which the server's int
parser refuses. Whole numbers are printed as integers.
*/}}
{{- define "chattts.flagValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{- int64 . -}}{{- else -}}{{- . -}}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Flags the chart sets from other values: `config` must not set them again. */}}
{{- define "chattts.derivedFlags" -}}
{{- list "host" "port" "http-port" "wyoming-port" "wyoming-allow-unauthenticated" "device" "cache-dir" "model-dir" "drain-timeout-s" "api-keys" "api-keys-file" "resume-secret-file" "advertise-url" | toJson -}}
{{- end -}}
