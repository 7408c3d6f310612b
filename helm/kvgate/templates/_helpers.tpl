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
ConfigMaps or the pod spec. (list $ role): with redis.acl the container connects as its role's
user (files/redis-acl.conf; role gateway, gateway-events or bridge) with that user's password.
*/}}
{{- define "kvgate.directoryEnv" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $url := include "kvgate.directoryUrl" $root -}}
{{- $secret := include "kvgate.redisSecretName" $root -}}
{{- $acl := $root.Values.redis.acl -}}
{{- if and $acl.enabled $secret }}
- name: KVGATE_DIRECTORY__URL
  value: {{ $url | quote }}
- name: KVGATE_DIRECTORY__USERNAME
  value: {{ printf "kvgate-%s" $role | quote }}
- name: KVGATE_DIRECTORY__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ printf "%s-password" $role }}
{{- else if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kvgate.redisSecretKey" $root }}
{{- $parts := splitn "://" 2 $url }}
- name: KVGATE_DIRECTORY__URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s" $parts._0 $parts._1 | quote }}
{{- else }}
- name: KVGATE_DIRECTORY__URL
  value: {{ $url | quote }}
{{- end }}
{{- end -}}

{{/* files/redis-acl.conf for this release's key prefix (redis.keyPrefix). */}}
{{- define "kvgate.redisAcl" -}}
{{- $p := .Values.redis.keyPrefix -}}
{{- .Files.Get "files/redis-acl.conf" | replace "~{kvgate}:" (printf "~{%s}:" $p) | replace "~kvgate:" (printf "~%s:" $p) -}}
{{- end -}}

{{/* Which Redis user the gateway is (redis.acl): it follows the engines' events itself when
discovery has an events port or a static node has an events endpoint. */}}
{{- define "kvgate.gatewayRedisRole" -}}
{{- $d := .Values.fleet.discovery -}}
{{- $events := and $d.enabled (not (kindIs "invalid" $d.eventsPort)) -}}
{{- range .Values.fleet.static }}{{ if .events_endpoint }}{{ $events = true }}{{ end }}{{ end -}}
{{- ternary "gateway-events" "gateway" $events -}}
{{- end -}}

{{/* The caller token Envoy sends kvgate (gateway.callerToken): its Secret, the placeholder the
bootstrap carries until the Envoy pod's init container writes the token in, its volume. */}}
{{- define "kvgate.callerTokenSecret" -}}
{{- default (printf "%s-caller-token" (include "kvgate.fullname" .)) .Values.gateway.callerToken.existingSecret -}}
{{- end -}}

{{- define "kvgate.callerTokenPlaceholder" -}}__KVGATE_CALLER_TOKEN__{{- end -}}

{{- define "kvgate.callerTokenVolume" -}}
{{- if .Values.gateway.callerToken.enabled }}
- name: caller-token
  secret:
    secretName: {{ include "kvgate.callerTokenSecret" . }}
    items: [{key: token, path: token}]
{{- end }}
{{- end -}}

{{/* The fleet's KV transfer secret (transfer.secret), for the engines' --transfer-secret-file. */}}
{{- define "kvgate.transferSecret" -}}
{{- default (printf "%s-transfer" (include "kvgate.fullname" .)) .Values.transfer.secret.existingSecret -}}
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
{{- else if and $d.enabled (eq $d.source "endpointslices") $d.service (kindIs "float64" $d.port) -}}
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

{{/* The decision port callers use: the TLS sidecar's when gateway.tls is on. */}}
{{- define "kvgate.kvgatePort" -}}
{{- if .Values.gateway.tls.enabled }}{{ .Values.gateway.tls.port | int }}{{ else }}{{ include "kvgate.kvgateServedPort" . }}{{ end -}}
{{- end -}}

{{/* The port kvgate itself serves decisions on (plaintext). */}}
{{- define "kvgate.kvgateServedPort" -}}
{{- if eq .Values.gateway.integration "ext_authz" }}{{ .Values.gateway.extAuthzPort | int }}{{ else }}{{ .Values.gateway.extProcPort | int }}{{ end -}}
{{- end -}}

{{/* The FQDN kvgate's TLS certificate must carry (SNI and SAN checked by Envoy). */}}
{{- define "kvgate.tlsServerName" -}}
{{- printf "%s.svc.%s" (printf "%s-gateway-headless.%s" (include "kvgate.fullname" .) .Release.Namespace) .Values.clusterDomain -}}
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
{{- if and (not $d.enabled) (not $v.fleet.static) (not $v.bridge.sidecar.enabled) -}}
{{- fail "no fleet: list nodes in fleet.static, set fleet.discovery.enabled=true, or let bridge.sidecar register the engine pods" -}}
{{- end -}}
{{- if and $v.bridge.sidecar.enabled $v.fleet.static -}}
{{- fail "bridge.sidecar registers every engine pod under its own name: leave fleet.static empty (listing the engines there too registers each twice)" -}}
{{- end -}}
{{- if or (eq (int $v.gateway.adminPort) (int $v.gateway.extProcPort)) (and (eq $v.gateway.integration "ext_authz") (eq (int $v.gateway.adminPort) (int $v.gateway.extAuthzPort))) -}}
{{- fail "gateway.adminPort must differ from gateway.extProcPort and gateway.extAuthzPort" -}}
{{- end -}}
{{- if and $v.gateway.autoscaling.enabled (gt (int $v.gateway.autoscaling.minReplicas) (int $v.gateway.autoscaling.maxReplicas)) -}}
{{- fail "gateway.autoscaling.minReplicas is above gateway.autoscaling.maxReplicas" -}}
{{- end -}}
{{- if and $v.gateway.tls.enabled (not $v.gateway.tls.secretName) -}}
{{- fail "gateway.tls.enabled needs gateway.tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and $v.gateway.tls.enabled (has (int $v.gateway.tls.port) (list (int $v.gateway.adminPort) (int $v.gateway.extProcPort) (int $v.gateway.extAuthzPort))) -}}
{{- fail "gateway.tls.port must differ from the gateway's other ports" -}}
{{- end -}}
{{- $fullname := include "kvgate.fullname" . -}}
{{- if gt (len $fullname) 46 -}}
{{- fail (printf "the release's objects are named %s-… and the longest (%s-gateway-headless) must fit 63 characters: use a shorter release name or fullnameOverride (at most 46 characters)" $fullname $fullname) -}}
{{- end -}}
{{- if and $v.envoy.enabled (gt (int $v.envoy.terminationGracePeriodSeconds) 0) (lt (int $v.envoy.terminationGracePeriodSeconds) (add (int $v.envoy.drainSeconds) (int $v.envoy.routeTimeoutSeconds))) -}}
{{- fail "envoy.terminationGracePeriodSeconds is shorter than envoy.drainSeconds + envoy.routeTimeoutSeconds: a rollout would cut generations in flight" -}}
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
{{- fail "envoy needs a fallback cluster: set envoy.fallback (e.g. the engines' headless Service, vllm.llm.svc.cluster.local:8000), or use fleet.discovery.source=endpointslices with a numeric fleet.discovery.port, or fleet.static" -}}
{{- end -}}
{{- $t := $v.tokenizer -}}
{{- $sources := 0 -}}
{{- range (list $t.huggingFace.model $t.volume $t.initContainers $t.builtinDeepSeek) }}{{ if . }}{{ $sources = add1 $sources }}{{ end }}{{ end -}}
{{- if and (eq $sources 0) (not (dig "tokenizer" "source" "" $v.gateway.config)) -}}
{{- fail "kvgate needs the engines' tokenizer (without it no block key matches and routing is by load only): set tokenizer.huggingFace.model (e.g. meta-llama/Llama-3.1-8B-Instruct), tokenizer.volume, or tokenizer.initContainers; tokenizer.builtinDeepSeek=true for DeepSeek V3/R1 models" -}}
{{- end -}}
{{- if gt $sources 1 -}}
{{- if not (and (eq $sources 2) $t.volume $t.initContainers) -}}
{{- fail "give the tokenizer one way: tokenizer.huggingFace.model, tokenizer.volume (optionally filled by tokenizer.initContainers), or tokenizer.builtinDeepSeek" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where the gateway reads the tokenizer; empty = kvgate's built-in (DeepSeek) or gateway.config's. */}}
{{- define "kvgate.tokenizerDir" -}}
{{- $t := .Values.tokenizer -}}
{{- if or $t.huggingFace.model $t.volume $t.initContainers -}}
{{- if $t.subPath }}/var/lib/kvgate/tokenizer/{{ $t.subPath }}{{ else }}/var/lib/kvgate/tokenizer{{ end -}}
{{- end -}}
{{- end -}}

{{/*
The tokenizer's volume and, for a Hugging Face model id, the init container that fetches it.
The download keeps what is already in the volume if the Hub is unreachable (a PVC cache), and
fails the pod with a sentence saying why otherwise.
*/}}
{{- define "kvgate.tokenizerVolume" -}}
{{- $t := .Values.tokenizer -}}
{{- if $t.volume }}
- name: tokenizer
  {{- toYaml $t.volume | nindent 2 }}
{{- else if $t.huggingFace.cacheClaim }}
- name: tokenizer
  persistentVolumeClaim: {claimName: {{ $t.huggingFace.cacheClaim }}}
{{- else if or $t.huggingFace.model $t.initContainers }}
- name: tokenizer
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "kvgate.tokenizerInitContainers" -}}
{{- $t := .Values.tokenizer -}}
{{- $hf := $t.huggingFace -}}
{{- if $hf.model }}
- name: fetch-tokenizer
  image: {{ include "kvgate.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["sh", "-c"]
  args:
    - |
      dir=/var/lib/kvgate/tokenizer
      if hf download "$HF_MODEL" --revision "$HF_REVISION" --local-dir "$dir" \
           --include 'tokenizer*' --include special_tokens_map.json --include 'chat_template*' \
         && [ -f "$dir/tokenizer.json" ]; then
        echo "tokenizer of $HF_MODEL@$HF_REVISION ready in $dir"  # fetched, or kept if the Hub is unreachable
      elif [ -f "$dir/tokenizer.json" ]; then
        echo "could not reach the Hub: using the tokenizer already in $dir" >&2
      else
        echo "no tokenizer for $HF_MODEL: a gated model needs tokenizer.huggingFace.tokenSecret (the Hub token), and the pod needs egress to huggingface.co" >&2
        exit 1
      fi
  env:
    - {name: HF_MODEL, value: {{ $hf.model | quote }}}
    - {name: HF_REVISION, value: {{ $hf.revision | quote }}}
    - {name: HF_HOME, value: /tmp/hf}
    - {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
    {{- if $hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ $hf.tokenSecret.name }}, key: {{ $hf.tokenSecret.key }}}
    {{- end }}
  resources:
    requests: {cpu: 100m, memory: 128Mi}
    limits: {memory: 512Mi}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: tokenizer, mountPath: /var/lib/kvgate/tokenizer}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- range $t.initContainers }}
{{- $c := mergeOverwrite (deepCopy .) (dict "volumeMounts" (append (default list .volumeMounts) (dict "name" "tokenizer" "mountPath" "/var/lib/kvgate/tokenizer"))) }}
{{- if not $c.securityContext }}{{ $_ := set $c "securityContext" $.Values.securityContext }}{{ end }}
- {{- toYaml $c | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Topology spread of a component: (list $ "component" $componentValues). */}}
{{- define "kvgate.spread" -}}
{{- $root := index . 0 -}}
{{- $c := index . 2 -}}
{{- if $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml $c.topologySpreadConstraints | nindent 2 }}
{{- else if $c.spreadAcrossNodes }}
topologySpreadConstraints:
  {{- range (list "kubernetes.io/hostname" "topology.kubernetes.io/zone") }}
  - maxSkew: 1
    topologyKey: {{ . }}
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "kvgate.selectorLabels" (list $root (index $ 1)) | nindent 8 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The Redis TLS files mounted from redis.external.tls.secretName (a volume and its mount). */}}
{{- define "kvgate.redisTlsVolume" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.secretName }}
- name: redis-tls
  secret: {secretName: {{ .Values.redis.external.tls.secretName }}}
{{- end }}
{{- end -}}

{{/* The same files named for `kvgate bridge` (its --tls-*-file flags read these variables). */}}
{{- define "kvgate.redisTlsEnv" -}}
{{- $tls := .Values.redis.external.tls -}}
{{- if and (eq .Values.redis.mode "external") $tls.secretName }}
{{- range $part, $key := dict "CA" $tls.caKey "CERT" $tls.certKey "KEY" $tls.keyKey }}
{{- if $key }}
- name: KVGATE_DIRECTORY__TLS_{{ $part }}_FILE
  value: /var/run/kvgate/redis-tls/{{ $key }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvgate.redisTlsMount" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.secretName }}
- {name: redis-tls, mountPath: /var/run/kvgate/redis-tls, readOnly: true}
{{- end }}
{{- end -}}
