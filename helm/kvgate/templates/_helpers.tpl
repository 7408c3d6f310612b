{{/* Names and labels. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
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

{{/* labels: (list $ "component") */}}
{{- define "kvgate.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvgate
{{ include "kvgate.selectorLabels" . }}
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvgate.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvgate.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "kvgate.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.fleet.discovery.namespace -}}
{{- end -}}

{{/* The directory URL without credentials (what the ConfigMap carries). */}}
{{- define "kvgate.directoryUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s-redis.%s:6379/0" (include "kvgate.fullname" .) (include "kvgate.svcDomain" .) -}}
{{- else if eq .Values.redis.mode "external" -}}
{{- .Values.redis.external.url -}}
{{- else -}}
memory://
{{- end -}}
{{- end -}}

{{/* The Secret and key holding the Redis password, as "name/key"; empty when there is none. */}}
{{- define "kvgate.redisSecretName" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- default (printf "%s-redis" (include "kvgate.fullname" .)) .Values.redis.bundled.existingSecret -}}
{{- else if eq .Values.redis.mode "external" -}}
{{- .Values.redis.external.passwordSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.redisSecretKey" -}}
{{- if eq .Values.redis.mode "external" -}}{{ .Values.redis.external.passwordSecret.key }}{{- else -}}password{{- end -}}
{{- end -}}

{{/*
Env vars giving a container the directory URL with its password: the password comes from the
Secret, and Kubernetes expands $(REDIS_PASSWORD) into the URL, so no secret is ever in values,
ConfigMaps or the pod spec.
*/}}
{{- define "kvgate.directoryEnv" -}}
{{- $url := include "kvgate.directoryUrl" . -}}
{{- $secret := include "kvgate.redisSecretName" . -}}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kvgate.redisSecretKey" . }}
{{- $parts := splitn "://" 2 $url }}
- name: KVGATE_DIRECTORY__URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s" $parts._0 $parts._1 | quote }}
{{- else }}
- name: KVGATE_DIRECTORY__URL
  value: {{ $url | quote }}
{{- end }}
{{- end -}}

{{/* The model whose name seeds block keys of discovered engines and bridges. */}}
{{- define "kvgate.model" -}}
{{- if .Values.models }}{{ first .Values.models }}{{ end -}}
{{- end -}}

{{/* Envoy's fallback cluster: explicit, else the engines' Service, else the static fleet. */}}
{{- define "kvgate.envoyFallback" -}}
{{- $d := .Values.fleet.discovery -}}
{{- if .Values.envoy.fallback -}}
{{- toJson .Values.envoy.fallback -}}
{{- else if and $d.enabled $d.service (kindIs "float64" $d.port) -}}
{{- list (printf "%s.%s.svc.%s:%d" $d.service (include "kvgate.discoveryNamespace" .) .Values.clusterDomain (int $d.port)) | toJson -}}
{{- else -}}
{{- $out := list -}}
{{- range .Values.fleet.static }}{{ $out = append $out .address }}{{ end -}}
{{- toJson $out -}}
{{- end -}}
{{- end -}}

{{/* host:port of kvgate as Envoy calls it: the headless Service, so Envoy balances streams over replicas. */}}
{{- define "kvgate.gatewayHeadless" -}}
{{- printf "%s-gateway-headless.%s" (include "kvgate.fullname" .) (include "kvgate.svcDomain" .) -}}
{{- end -}}

{{- define "kvgate.kvgatePort" -}}
{{- if eq .Values.gateway.integration "ext_authz" }}{{ .Values.gateway.extAuthzPort | int }}{{ else }}{{ .Values.gateway.extProcPort | int }}{{ end -}}
{{- end -}}

{{/*
Rules no JSON schema can say clearly. Each fails the install with what to change.
*/}}
{{- define "kvgate.validate" -}}
{{- $v := .Values -}}
{{- $d := $v.fleet.discovery -}}
{{- if and (eq $v.redis.mode "none") (or $v.gateway.autoscaling.enabled (gt (int $v.gateway.replicas) 1)) -}}
{{- fail "redis.mode=none keeps the directory in one gateway's memory: set gateway.replicas=1 and gateway.autoscaling.enabled=false, or use redis.mode=bundled or external" -}}
{{- end -}}
{{- if and (eq $v.redis.mode "external") (not $v.redis.external.url) -}}
{{- fail "redis.mode=external needs redis.external.url (e.g. redis://redis.example:6379/0)" -}}
{{- end -}}
{{- if and (eq $v.redis.mode "none") (or $v.bridge.sidecar.enabled $v.bridge.standalone.enabled) -}}
{{- fail "bridges write to a shared directory: redis.mode=none cannot be used with bridge.sidecar or bridge.standalone" -}}
{{- end -}}
{{- if and $d.enabled (or $v.bridge.sidecar.enabled $v.bridge.standalone.enabled) -}}
{{- fail "with fleet.discovery the gateway registers discovered pods and follows their KV events itself (set fleet.discovery.eventsPort); disable bridge.sidecar and bridge.standalone, or discovery" -}}
{{- end -}}
{{- if and $v.bridge.standalone.enabled (not $v.bridge.standalone.engines) -}}
{{- fail "bridge.standalone.enabled needs bridge.standalone.engines" -}}
{{- end -}}
{{- if and (not $d.enabled) (not $v.fleet.static) -}}
{{- fail "no fleet: list nodes in fleet.static or set fleet.discovery.enabled=true" -}}
{{- end -}}
{{- if and $d.enabled (eq $d.source "endpointslices") (not (or $d.service $d.labelSelector)) -}}
{{- fail "fleet.discovery.source=endpointslices needs fleet.discovery.service (the engines' Service)" -}}
{{- end -}}
{{- if and $d.enabled (eq $d.source "pods") (not $d.labelSelector) -}}
{{- fail "fleet.discovery.source=pods needs fleet.discovery.labelSelector (e.g. app=vllm)" -}}
{{- end -}}
{{- if and (or (and $d.enabled (not (kindIs "invalid" $d.eventsPort))) $v.bridge.sidecar.enabled $v.bridge.standalone.enabled) (not $v.models) -}}
{{- fail "KV events are keyed by model name: set models (e.g. [meta-llama/Llama-3.1-8B-Instruct])" -}}
{{- end -}}
{{- if and $v.envoy.enabled (eq (include "kvgate.envoyFallback" . | fromJsonArray | len) 0) -}}
{{- fail "envoy needs a fallback cluster: set envoy.fallback, or fleet.discovery.service with a numeric fleet.discovery.port, or fleet.static" -}}
{{- end -}}
{{- end -}}
