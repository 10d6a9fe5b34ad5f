{{- define "kvpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "kvpool.selectorLabels" . }}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.tenantsSecret" -}}
{{- default (printf "%s-tenants" (include "kvpool.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* A flag value as kvpoold's config file wants it: whole numbers without an exponent. */}}
{{- define "kvpool.flagValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Checks the chart refuses to render without. */}}
{{- define "kvpool.checks" -}}
{{- if and .Values.auth.insecure (or .Values.auth.existingSecret .Values.auth.tenantsFile) -}}
{{- fail "auth.insecure serves without identities: leave auth.existingSecret and auth.tenantsFile empty with it" -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- if not .Values.tls.secretName -}}
{{- fail "tls.enabled needs tls.secretName" -}}
{{- end -}}
{{- end -}}
{{- $grace := add (mul .Values.preStopSleepSeconds 1000) (int64 .Values.daemon.shutdown_grace_ms) -}}
{{- if le (mul (int64 .Values.terminationGracePeriodSeconds) 1000) $grace -}}
{{- fail (printf "terminationGracePeriodSeconds (%v s) must exceed preStopSleepSeconds + daemon.shutdown_grace_ms (%v ms)" .Values.terminationGracePeriodSeconds $grace) -}}
{{- end -}}
{{- if and (gt (int .Values.gpu.count) 0) (not (hasPrefix "cuda:" (toString .Values.daemon.device))) -}}
{{- fail "gpu.count > 0 needs daemon.device cuda:N" -}}
{{- end -}}
{{- end -}}

{{/* The name the server certificate is checked against by in-cluster callers of the gRPC port. */}}
{{- define "kvpool.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "kvpool.fullname" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}
