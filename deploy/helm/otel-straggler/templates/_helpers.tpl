{{/* The chart's name, and the full name objects are prefixed with (63 characters at most). */}}
{{- define "otel-straggler.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "otel-straggler.fullname" -}}
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

{{/* Object names of the three parts; the suffixes leave room within 63 characters. */}}
{{- define "otel-straggler.gateway" -}}{{ include "otel-straggler.fullname" . | trunc 52 | trimSuffix "-" }}-gateway{{- end -}}
{{- define "otel-straggler.detector" -}}{{ include "otel-straggler.fullname" . | trunc 45 | trimSuffix "-" }}-detector{{- end -}}
{{- define "otel-straggler.agent" -}}{{ include "otel-straggler.fullname" . | trunc 54 | trimSuffix "-" }}-agent{{- end -}}

{{- define "otel-straggler.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "otel-straggler.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one part: include with (list $ "gateway"). */}}
{{- define "otel-straggler.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "otel-straggler.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The collector image of a part: its own keys over collectorImage's. */}}
{{- define "otel-straggler.collectorImage" -}}
{{- $root := index . 0 -}}
{{- $image := merge (dict) (index . 1) $root.Values.collectorImage -}}
image: {{ printf "%s:%s" $image.repository (toString $image.tag) | quote }}
imagePullPolicy: {{ $image.pullPolicy }}
{{- end -}}

{{/* The gateway's OTLP/gRPC address inside the cluster. */}}
{{- define "otel-straggler.gatewayEndpoint" -}}
{{ include "otel-straggler.gateway" . }}.{{ .Release.Namespace }}.svc:4317
{{- end -}}

{{- define "otel-straggler.authSecret" -}}
{{- default (printf "%s-auth" (include "otel-straggler.detector" .)) .Values.detector.auth.existingSecret -}}
{{- end -}}

{{- define "otel-straggler.tlsServerName" -}}
{{- default (include "otel-straggler.detector" .) .Values.detector.tls.serverName -}}
{{- end -}}

{{/* Settings that cannot work together fail the render with a sentence. */}}
{{- define "otel-straggler.validate" -}}
{{- if and .Values.detector.auth.enabled (not .Values.detector.tls.enabled) -}}
{{- fail "detector.auth.enabled needs detector.tls.enabled: gRPC sends bearer tokens only over TLS" -}}
{{- end -}}
{{- if and .Values.detector.auth.enabled (not .Values.detector.auth.existingSecret) (not .Values.detector.auth.token) -}}
{{- fail "detector.auth.enabled needs detector.auth.existingSecret or detector.auth.token" -}}
{{- end -}}
{{- if and .Values.detector.tls.enabled (not .Values.detector.tls.existingSecret) -}}
{{- fail "detector.tls.enabled needs detector.tls.existingSecret (a kubernetes.io/tls Secret with ca.crt)" -}}
{{- end -}}
{{- if lt (int .Values.detector.shards) 1 -}}
{{- fail "detector.shards must be at least 1" -}}
{{- end -}}
{{- end -}}
