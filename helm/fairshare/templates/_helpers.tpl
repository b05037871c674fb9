{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "fairshare.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-fairshare, or the release name when it already contains the chart name. Kept to 40
characters so that "<fullname>-worker-<i>" pod names and their DNS labels stay below 63. */}}
{{- define "fairshare.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fairshare.gateway.fullname" -}}{{ include "fairshare.fullname" . }}-gateway{{- end -}}
{{- define "fairshare.worker.fullname" -}}{{ include "fairshare.fullname" . }}-worker{{- end -}}
{{- define "fairshare.redis.fullname" -}}{{ include "fairshare.fullname" . }}-redis{{- end -}}
{{- define "fairshare.tenants.configmap" -}}{{ include "fairshare.fullname" . }}-tenants{{- end -}}

{{- define "fairshare.secretName" -}}
{{- default (printf "%s-secrets" (include "fairshare.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "fairshare.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fairshare.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------------- */}}

{{- define "fairshare.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "fairshare.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fairshare
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "fairshare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fairshare.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fairshare.componentLabels" -}}
{{ include "fairshare.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Images ----------------------------------------------------------------------------------- */}}

{{/* Call with (dict "ctx" $ "image" .Values.gateway.image). */}}
{{- define "fairshare.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if .ctx.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .ctx.Values.image.registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Addresses -------------------------------------------------------------------------------- */}}

{{/* The gateway's worker entry: every address of the workers' headless Service, discovered live
(gateway/discovery.py re-resolves it every few seconds), so scaling the StatefulSet needs nothing else. */}}
{{- define "fairshare.workerDiscovery" -}}
{{- $worker := include "fairshare.worker.fullname" . -}}
{{- printf "dns:///%s.%s.svc.%s:%d" $worker .Release.Namespace .Values.clusterDomain (int .Values.worker.port) -}}
{{- end -}}

{{/* The Redis URL as an env entry's value or valueFrom (call with (dict "ctx" $ "name" "FAIRSHARE_REDIS_URL")). */}}
{{- define "fairshare.redisUrlEnv" -}}
- name: {{ .name }}
{{- if .ctx.Values.redis.enabled }}
  value: {{ include "fairshare.redisUrl" .ctx | quote }}
{{- else if .ctx.Values.redis.external.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .ctx.Values.redis.external.existingSecret.name }}
      key: {{ .ctx.Values.redis.external.existingSecret.key }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "fairshare.secretName" .ctx }}
      key: redis-url
{{- end }}
{{- end -}}

{{/* Whether workers order by pool-wide counters through Redis (the reference engine's --pool-redis-url). */}}
{{- define "fairshare.worker.pool" -}}
{{- if and .Values.worker.poolCounters (eq .Values.worker.engine "reference") -}}true{{- end -}}
{{- end -}}

{{- define "fairshare.redisUrl" -}}
{{- printf "redis://%s.%s.svc.%s:6379/0" (include "fairshare.redis.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* The server secret: the value given, else the one already stored in the release's Secret,
else a new random one. */}}
{{- define "fairshare.serverSecret" -}}
{{- if .Values.secrets.serverSecret -}}
{{- .Values.secrets.serverSecret | trim -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "fairshare.secretName" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "server-secret") -}}
{{- index $existing.data "server-secret" | b64dec -}}
{{- else -}}
{{- randAlphaNum 64 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The worker-auth keys: the value given, else the ones already stored in the release's Secret,
else one new random key. */}}
{{- define "fairshare.workerKeys" -}}
{{- if .Values.secrets.workerKeys -}}
{{- .Values.secrets.workerKeys | trim -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "fairshare.secretName" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "worker-keys") -}}
{{- index $existing.data "worker-keys" | b64dec -}}
{{- else -}}
{{- printf "k1:%s" (randAlphaNum 64) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Checks that the schema cannot express. */}}
{{- define "fairshare.validate" -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret.name) -}}
{{- fail "redis.enabled=false needs redis.external.url or redis.external.existingSecret.name" -}}
{{- end -}}
{{- if and (eq .Values.worker.engine "sglang") (not .Values.worker.gpu.enabled) -}}
{{- fail "worker.engine=sglang runs on GPUs: set worker.gpu.enabled=true" -}}
{{- end -}}
{{- if and .Values.worker.modelVolume.enabled (not .Values.worker.modelVolume.source) -}}
{{- fail "worker.modelVolume.enabled=true needs worker.modelVolume.source (a pod volume source)" -}}
{{- end -}}
{{- if eq (int .Values.gateway.metrics.port) (int .Values.gateway.port) -}}
{{- fail "gateway.metrics.port must differ from gateway.port (the admin listener serves /metrics apart from the API)" -}}
{{- end -}}
{{- if and .Values.worker.metrics.enabled (eq (int .Values.worker.metrics.port) (int .Values.worker.port)) -}}
{{- fail "worker.metrics.port must differ from worker.port" -}}
{{- end -}}
{{- $w := .Values.worker -}}
{{- if and (has $w.quantization (list "int8" "int4")) (eq $w.engine "reference") -}}
{{- if eq $w.dtype "float32" -}}
{{- fail (printf "worker.quantization=%s needs worker.dtype bfloat16 or auto (its CPU kernel takes bfloat16 activations)" $w.quantization) -}}
{{- end -}}
{{- if hasPrefix "cuda" $w.device -}}
{{- fail (printf "worker.quantization=%s runs on the CPU; use worker.quantization=none with worker.device=%s" $w.quantization $w.device) -}}
{{- end -}}
{{- end -}}
{{- $q := .Values.worker.kvQuota -}}
{{- if and $q.enabled (ge (addf (float64 (default 0 $q.headroom)) (float64 (default 0 $q.sharedBuffer))) 1.0) -}}
{{- fail "worker.kvQuota: headroom + sharedBuffer must be < 1" -}}
{{- end -}}
{{- range .Values.tenants -}}
{{- if hasKey . "api_key_digests" -}}
{{- fail (printf "tenant %s: api_key_digests belong in the Secret (secrets.keysFile), not in tenants" .id) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether workers serve Prometheus metrics (--metrics-port; both engines). */}}
{{- define "fairshare.worker.metrics" -}}
{{- if .Values.worker.metrics.enabled -}}true{{- end -}}
{{- end -}}
