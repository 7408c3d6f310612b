{{/*
The preStop hook that drains an engine pod before it goes (kvgate drain, through the gateway's
admin API): include it in your vLLM StatefulSet's engine container,

  lifecycle:
    {{- include "kvgate.drainPreStop" (dict "root" $) | nindent 4 }}

with terminationGracePeriodSeconds above drain.deadlineSeconds + 10. The pod's name (its
hostname) is its node_id (discovery registers pods by name); the hook reads the admin token from
drain.tokenFile (mount the Secret that kvgate's admin.token_file reads) and needs the label
kvgate.io/admin-client=true on the pod to reach the admin port. It only needs python3 (every vLLM
image has it), gives up at the deadline plus 5 s, and never fails the pod's termination.
*/}}
{{- define "kvgate.drainPreStop" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $deadline := .deadlineSeconds | default $v.drain.deadlineSeconds -}}
{{- $url := printf "http://%s-gateway.%s.svc.%s:%v" (include "kvgate.fullname" $root) $root.Release.Namespace $v.clusterDomain $v.gateway.adminPort -}}
preStop:
  exec:
    command:
      - python3
      - -c
      - |
        import os, sys, urllib.request as u
        deadline = {{ $deadline }}
        try:
            token = open({{ $v.drain.tokenFile | quote }}).read().strip()
            req = u.Request({{ $url | quote }} + "/admin/drain/" + os.environ["HOSTNAME"] + "?deadline_s=" + str(deadline),
                            method="POST", headers={"Authorization": "Bearer " + token})
            print(u.urlopen(req, timeout=deadline + 5).read().decode())
        except Exception as e:  # a drain that cannot run must not hold the pod
            print("kvgate drain failed:", e, file=sys.stderr)
{{- end -}}
