{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "minillm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, with the chart's unless it already holds it. */}}
{{- define "minillm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "minillm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "minillm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minillm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "minillm.labels" -}}
helm.sh/chart: {{ include "minillm.chart" . }}
{{ include "minillm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "minillm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "minillm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server's image; there is none to default to, so a missing repository says how to make one. */}}
{{- define "minillm.image" -}}
{{- $repository := required "image.repository is required: build and push the server's image (docker build -t REGISTRY/minillm:TAG . && docker push REGISTRY/minillm:TAG; README, \"Deploy on Kubernetes\"), then --set image.repository=REGISTRY/minillm --set image.tag=TAG" .Values.image.repository }}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The label that lets a pod through the NetworkPolicy. */}}
{{- define "minillm.clientLabel" -}}
{{- printf "%s-client" (include "minillm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* MINILLM_MODEL: the downloaded repo's directory, else model.name. */}}
{{- define "minillm.model" -}}
{{- if .Values.model.download.enabled }}
{{- $repo := required "model.download.repoId is required when model.download.enabled" .Values.model.download.repoId }}
{{- printf "%s/%s" (trimSuffix "/" .Values.storage.mountPath) $repo }}
{{- else }}
{{- .Values.model.name }}
{{- end }}
{{- end }}

{{/* The model name clients send; the server's own default, made explicit for NOTES and the test. */}}
{{- define "minillm.servedModelName" -}}
{{- $model := include "minillm.model" . }}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if eq $model "default" }}
{{- "SmolLM2-135M-Instruct" }}
{{- else }}
{{- $model | trimSuffix "/" | splitList "/" | last }}
{{- end }}
{{- end }}

{{- define "minillm.gpuCount" -}}
{{- if kindIs "invalid" .Values.gpu.count }}
{{- int64 .Values.engine.tensorParallelSize }}
{{- else }}
{{- int64 .Values.gpu.count }}
{{- end }}
{{- end }}

{{- define "minillm.terminationGracePeriodSeconds" -}}
{{- $needed := add (int64 .Values.preStopSleepSeconds) (int64 .Values.server.shutdownGrace) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $needed 15 }}
{{- else if le (int64 .Values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + server.shutdownGrace (%v): the drain would be killed" .Values.terminationGracePeriodSeconds $needed) }}
{{- else }}
{{- int64 .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* The Secret holding the API keys, or "" when there are none. */}}
{{- define "minillm.apiKeySecret" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys }}
{{- printf "%s-api-keys" (include "minillm.fullname" .) }}
{{- end }}
{{- end }}

{{/* A value as an env string: YAML numbers reach templates as float64, which print as 1.048576e+07. */}}
{{- define "minillm.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) }}
{{- int64 . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* MINILLM_<NAME> env entries (a YAML list, or nothing) from a map of camelCase flags; null and ""
are left out. */}}
{{- define "minillm.flagEnv" -}}
{{- $env := list }}
{{- range $key, $value := . }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "")) }}
{{- $env = append $env (dict "name" (printf "MINILLM_%s" ($key | snakecase | upper)) "value" (include "minillm.envValue" $value)) }}
{{- end }}
{{- end }}
{{- with $env }}{{ toYaml . }}{{ end }}
{{- end }}
