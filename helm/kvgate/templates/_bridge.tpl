{{/*
The KV-event bridge container: (dict "root" $ "engines" (list "node_id=…,address=…,events=…") "metricsPort" 0).
The directory URL (with the password) reaches it in KVGATE_DIRECTORY__URL, never as an argument; with
redis.external.tls the Secret's files are mounted (volume `redis-tls`) and named in KVGATE_DIRECTORY__TLS_*_FILE. Key prefix, model, block size and heartbeat TTL are the gateway's, so what the
bridge writes is what the gateway reads.
*/}}
{{- define "kvgate.bridgeContainer" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
name: kvgate-bridge
image: {{ include "kvgate.image" $root }}
imagePullPolicy: {{ $v.image.pullPolicy }}
command: ["kvgate"]
args:
  - bridge
  - --key-prefix
  - {{ $v.redis.keyPrefix | quote }}
  - --model
  - {{ include "kvgate.model" $root | quote }}
  - --block-size
  - {{ $v.blockSize | quote }}
  - --heartbeat-ttl
  - {{ dig "directory" "heartbeat_ttl_s" 10 $v.gateway.config | quote }}
  {{- with (dig "directory" "index_stride" nil $v.gateway.config) }}
  - --index-stride
  - {{ . | quote }}
  {{- end }}
  {{- if .metricsPort }}
  - --metrics-port
  - {{ .metricsPort | quote }}
  - --metrics-host
  - 0.0.0.0
  {{- end }}
  {{- range .engines }}
  - --engine
  - {{ . | quote }}
  {{- end }}
env:
  - name: POD_NAME
    valueFrom:
      fieldRef: {fieldPath: metadata.name}
  - name: POD_IP
    valueFrom:
      fieldRef: {fieldPath: status.podIP}
  {{- include "kvgate.directoryEnv" (list $root "bridge") | nindent 2 }}
  {{- include "kvgate.redisTlsEnv" $root | nindent 2 }}
  {{- with .extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $tlsMount := include "kvgate.redisTlsMount" $root }}
{{- if or $tlsMount .extraVolumeMounts }}
volumeMounts:
  {{- $tlsMount | nindent 2 }}
  {{- with .extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- if .metricsPort }}
ports:
  - name: metrics
    containerPort: {{ .metricsPort }}
    protocol: TCP
livenessProbe:
  httpGet: {path: /metrics, port: metrics}
  periodSeconds: 15
{{- end }}
resources:
  {{- toYaml .resources | nindent 2 }}
securityContext:
  {{- toYaml $v.securityContext | nindent 2 }}
{{- end -}}
