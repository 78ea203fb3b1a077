{{/* Names */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The headless Service of a worker pool: (dict "root" . "role" "prefill") */}}
{{- define "pdserve.headlessName" -}}
{{- printf "%s-%s-headless" (include "pdserve.fullname" .root) .role -}}
{{- end -}}

{{/* host:port of a worker pool's headless Service, fully qualified; with expertParallel N,
one per rank (port + r), comma-separated. Each name resolves to every pod and gRPC's
pick_first picks one per address, so a group is whole only with a single pod. */}}
{{- define "pdserve.poolAddress" -}}
{{- $pool := index .root.Values .role -}}
{{- $n := include "pdserve.expertParallel" (dict "root" .root "component" .role) | int -}}
{{- if and (gt $n 1) (or (gt (int $pool.replicas) 1) $pool.autoscaling.enabled) -}}
{{- fail (printf "%s.expertParallel > 1 with coordinator.discovery=static needs %s.replicas: 1 and no autoscaling (the Service name cannot tell which ranks share a pod); use coordinator.discovery=kubernetes" .role .role) -}}
{{- end -}}
{{- $host := printf "%s.%s.svc.%s" (include "pdserve.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- $addresses := list -}}
{{- range $r := until $n -}}
{{- $addresses = append $addresses (printf "%s:%d" $host (add (int $pool.port) $r)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* Labels */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" . "component" "prefill") */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: preStop sleep + drain + 15 s to exit. */}}
{{- define "pdserve.gracePeriod" -}}
{{- add (int .Values.termination.preStopSleepSeconds) (int (ceil .Values.termination.drainTimeoutSeconds)) 15 -}}
{{- end -}}

{{/* Environment shared by every pdserve container: caches on writable volumes, OTel. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_DRAIN_TIMEOUT
  value: {{ .Values.termination.drainTimeoutSeconds | quote }}
- name: PDSERVE_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: PDSERVE_CACHE_DIR
  value: {{ ternary "/opt/pdserve/cache" "/var/cache/pdserve" (and (eq .Values.model.source "bundled") .Values.image.modelBaked) | quote }}
- name: PDSERVE_BUILD_DIR
  value: /var/cache/pdserve/torch_extensions
{{- if ne .Values.model.source "bundled" }}
- name: PDSERVE_MODEL
  value: {{ .Values.model.mountPath | quote }}
{{- end }}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /var/cache/pdserve/huggingface
- name: TRITON_CACHE_DIR
  value: /var/cache/pdserve/triton
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- if .Values.otel.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.otel.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .Values.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .Values.otel.samplerArg | quote }}
- name: OTEL_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(OTEL_POD_NAME)%s" .Release.Namespace (ternary (printf ",%s" .Values.otel.resourceAttributes) "" (ne .Values.otel.resourceAttributes "")) | quote }}
{{- end }}
{{- end -}}

{{/* Volumes of every pdserve pod: (dict "root" . "shm" true) */}}
{{- define "pdserve.volumes" -}}
{{- $v := .root.Values -}}
- name: cache
  emptyDir:
    sizeLimit: {{ $v.cacheSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if and .shm $v.ucx.shm.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.ucx.shm.sizeLimit }}
{{- end }}
{{- if eq $v.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $v.model.pvc.claimName }}
    readOnly: true
{{- else if eq $v.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $v.model.hostPath.path }}
    type: Directory
{{- else if eq $v.model.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $v.model.image.sizeLimit }}
{{- end }}
{{- if $v.tls.enabled }}
# Mounted whole (no subPath), so kubelet's updates of a renewed Secret reach the files.
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" .root }}
    defaultMode: {{ include "pdserve.secretMode" .root }}
{{- with $v.tls.trustBundle.configMapName }}
- name: tls-ca
  configMap:
    name: {{ . }}
    items:
      - key: {{ $v.tls.trustBundle.key }}
        path: {{ $v.tls.trustBundle.key }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: cache
  mountPath: /var/cache/pdserve
- name: tmp
  mountPath: /tmp
{{- if and .shm $v.ucx.shm.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if ne $v.model.source "bundled" }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: true
  {{- if and (eq $v.model.source "pvc") $v.model.pvc.subPath }}
  subPath: {{ $v.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- if $v.tls.trustBundle.configMapName }}
- name: tls-ca
  mountPath: /etc/pdserve/tls-ca
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* The init container that copies an image-packaged model into the model emptyDir. */}}
{{- define "pdserve.modelInit" -}}
{{- $v := .Values -}}
{{- if eq $v.model.source "image" }}
initContainers:
  - name: model
    image: {{ printf "%s:%s" $v.model.image.repository $v.model.image.tag }}
    imagePullPolicy: {{ $v.model.image.pullPolicy }}
    command: ["cp", "-R", "{{ trimSuffix "/" $v.model.image.path }}/.", "/model-dest/"]
    securityContext:
      {{- toYaml $v.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: /model-dest
{{- end }}
{{- end -}}

{{/* Native gRPC probes on grpc.health.v1 (SERVING once the model is loaded), on the gRPC port
or, where that port speaks TLS, on the plain health port (kubelet's gRPC probes speak
plaintext only): (dict "port" PORT "startupProbe" $pool.startupProbe) */}}
{{- define "pdserve.probes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .startupProbe.periodSeconds }}
  failureThreshold: {{ .startupProbe.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 2
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  failureThreshold: 6
  timeoutSeconds: 5
{{- end -}}

{{- define "pdserve.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.termination.preStopSleepSeconds }}"]
{{- end -}}

{{/* Pod scheduling of a pool: its affinity plus anti-affinity within the pool. */}}
{{- define "pdserve.affinity" -}}
{{- $pool := index .root.Values .component -}}
{{- $affinity := deepCopy $pool.affinity -}}
{{- $mode := $pool.podAntiAffinity | default "none" -}}
{{- if and (not (hasKey $affinity "podAntiAffinity")) (ne $mode "none") -}}
{{- $term := dict "labelSelector" (dict "matchLabels" (include "pdserve.selectorLabels" . | fromYaml)) "topologyKey" "kubernetes.io/hostname" -}}
{{- if eq $mode "hard" -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) -}}
{{- else -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- end -}}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A name: value map as env entries. */}}
{{- define "pdserve.envMap" -}}
{{- range $k, $val := . }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- end -}}

{{/* The tensor-parallel rank count of a worker pool (dict "root" . "component" "decode"),
checked: an integer >= 1, not combined with expertParallel, no single cuda:N device. The
pod asks for max(gpus, tensorParallel) GPUs when gpus > 0 (rank r uses cuda:r). */}}
{{- define "pdserve.tensorParallel" -}}
{{- $role := .component -}}
{{- $pool := index .root.Values $role -}}
{{- $tp := 1 -}}
{{- if hasKey $pool "tensorParallel" -}}{{- $tp = $pool.tensorParallel -}}{{- end -}}
{{- $isNumber := or (kindIs "int64" $tp) (kindIs "int" $tp) (kindIs "float64" $tp) -}}
{{- if or (not $isNumber) (and $isNumber (or (lt (float64 $tp) 1.0) (ne (float64 $tp) (float64 (int64 $tp))))) -}}
{{- fail (printf "%s.tensorParallel must be an integer >= 1 (the tensor-parallel rank processes of each pod), got %v" $role $tp) -}}
{{- end -}}
{{- if and (gt (int $tp) 1) (gt (int $pool.expertParallel) 1) -}}
{{- fail (printf "%s.tensorParallel and %s.expertParallel cannot both be > 1 yet" $role $role) -}}
{{- end -}}
{{- if and (gt (int $tp) 1) (hasPrefix "cuda:" $pool.device) -}}
{{- fail (printf "%s.device %s would put every rank on one GPU: with tensorParallel > 1 use cuda (rank r takes cuda:r)" $role $pool.device) -}}
{{- end -}}
{{- int $tp -}}
{{- end -}}

{{/* The expert-parallel rank count of a worker pool, checked with what depends on it:
(dict "root" . "component" "decode"). Rank r of a pod listens on port + r and metrics.port + r
and uses cuda:r. The schema checks the types too; this also covers --skip-schema-validation. */}}
{{- define "pdserve.expertParallel" -}}
{{- $v := .root.Values -}}
{{- $role := .component -}}
{{- $pool := index $v $role -}}
{{- $ep := $pool.expertParallel -}}
{{- $isNumber := or (kindIs "int64" $ep) (kindIs "int" $ep) (kindIs "float64" $ep) -}}
{{- if or (not $isNumber) (and $isNumber (or (lt (float64 $ep) 1.0) (ne (float64 $ep) (float64 (int64 $ep))))) -}}
{{- fail (printf "%s.expertParallel must be an integer >= 1 (the expert-parallel rank processes of each pod; 1 for a dense model), got %v" $role $ep) -}}
{{- end -}}
{{- $n := int $ep -}}
{{- $k := $pool.redundantExperts | default 0 -}}
{{- if or (not (or (kindIs "int64" $k) (kindIs "int" $k) (kindIs "float64" $k))) (lt (float64 $k) 0.0) (ne (float64 $k) (float64 (int64 $k))) -}}
{{- fail (printf "%s.redundantExperts must be an integer >= 0, got %v" $role $k) -}}
{{- end -}}
{{- if and (gt (int $k) 0) (lt $n 2) -}}
{{- fail (printf "%s.redundantExperts needs %s.expertParallel >= 2, got %d" $role $role $n) -}}
{{- end -}}
{{- if and (gt (int $k) 0) (ne (mod (int $k) $n) 0) -}}
{{- fail (printf "%s.redundantExperts must be a multiple of %s.expertParallel (%d), got %d" $role $role $n (int $k)) -}}
{{- end -}}
{{- if and (gt (int $pool.gpus) 0) (lt (int $pool.gpus) $n) -}}
{{- fail (printf "%s.gpus is %d but %s.expertParallel is %d: each rank uses a GPU of its own (rank r: cuda:r), so gpus must be >= expertParallel (or 0 on CPU)" $role (int $pool.gpus) $role $n) -}}
{{- end -}}
{{- if and (gt $n 1) (hasPrefix "cuda:" $pool.device) -}}
{{- fail (printf "%s.device %s would put every rank on one GPU: with expertParallel > 1 use cuda (rank r takes cuda:r)" $role $pool.device) -}}
{{- end -}}
{{- $grpc := int $pool.port -}}
{{- $metrics := int $v.metrics.port -}}
{{- if gt (add $grpc $n -1) 65535 -}}
{{- fail (printf "%s: ports %d..%d (port + rank) go past 65535" $role $grpc (add $grpc $n -1)) -}}
{{- end -}}
{{- if gt (add $metrics $n -1) 65535 -}}
{{- fail (printf "%s: metrics ports %d..%d (metrics.port + rank) go past 65535" $role $metrics (add $metrics $n -1)) -}}
{{- end -}}
{{- if and (le $grpc (add $metrics $n -1)) (le $metrics (add $grpc $n -1)) -}}
{{- fail (printf "%s: gRPC ports %d..%d and metrics ports %d..%d overlap (rank r listens on port + r and metrics.port + r)" $role $grpc (add $grpc $n -1) $metrics (add $metrics $n -1)) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* --- TLS ------------------------------------------------------------------------------ */}}

{{/* The internal certificate's Secret: tls.secretName, or the name the chart's Certificate
writes by default. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "pdserve.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{/* Mode of mounted Secret files: 0440 with an fsGroup (the pod's group reads them), 0444
without one (the files are root's, the process is not). */}}
{{- define "pdserve.secretMode" -}}
{{- ternary 288 292 (not (empty .Values.podSecurityContext.fsGroup)) -}}
{{- end -}}

{{/* The TLS values checked with what depends on them; called once per render. The schema
checks types; this also covers --skip-schema-validation. */}}
{{- define "pdserve.tlsChecks" -}}
{{- $t := .Values.tls -}}
{{- if and $t.enabled (not $t.secretName) (not $t.certManager.enabled) -}}
{{- fail "tls.enabled needs tls.secretName (an existing kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt) or tls.certManager.enabled (the chart then renders a cert-manager Certificate writing that Secret)" -}}
{{- end -}}
{{- if and $t.certManager.enabled (not $t.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name (the cert-manager Issuer or ClusterIssuer that signs the certificate)" -}}
{{- end -}}
{{- if not $t.serverName -}}
{{- fail "tls.serverName must be a DNS name (the SAN peers verify)" -}}
{{- end -}}
{{- end -}}

{{/* Whether a component serves the plain health port ("true" or ""): every pod with
tls.enabled, and the coordinator also with coordinator.publicTls (its gRPC port then speaks
TLS). (dict "root" . "component" "decode") */}}
{{- define "pdserve.healthOn" -}}
{{- $v := .root.Values -}}
{{- if or $v.tls.enabled (and (eq .component "coordinator") $v.coordinator.publicTls.secretName) -}}
true
{{- end -}}
{{- end -}}

{{/* The health port of a component, checked against its other ports: an expert-parallel
rank r serves health on tls.healthPort + r, like its other ports.
(dict "root" . "component" "decode") */}}
{{- define "pdserve.healthPort" -}}
{{- $v := .root.Values -}}
{{- $h := int $v.tls.healthPort -}}
{{- $n := 1 -}}
{{- $others := dict "metrics.port" (int $v.metrics.port) -}}
{{- if eq .component "coordinator" -}}
{{- $_ := set $others "coordinator.port" (int $v.coordinator.port) -}}
{{- if $v.coordinator.http.enabled -}}
{{- $_ := set $others "coordinator.http.port" (int $v.coordinator.http.port) -}}
{{- end -}}
{{- else -}}
{{- $n = include "pdserve.expertParallel" . | int -}}
{{- $_ := set $others (printf "%s.port" .component) (int (index $v .component).port) -}}
{{- end -}}
{{- if gt (add $h $n -1) 65535 -}}
{{- fail (printf "%s: health ports %d..%d (tls.healthPort + rank) go past 65535" .component $h (add $h $n -1)) -}}
{{- end -}}
{{- range $name, $p := $others -}}
{{- if and (le $h (add $p $n -1)) (le $p (add $h $n -1)) -}}
{{- fail (printf "%s: health ports %d..%d (tls.healthPort + rank) overlap %s %d..%d" $.component $h (add $h $n -1) $name $p (add $p $n -1)) -}}
{{- end -}}
{{- end -}}
{{- $h -}}
{{- end -}}

{{/* The TLS environment of a pdserve container: (dict "root" . "component" "decode") */}}
{{- define "pdserve.tlsEnv" -}}
{{- $v := .root.Values -}}
{{- if $v.tls.enabled }}
# Mutual TLS between the pods: these files (the mounted Secret) are re-read when kubelet
# updates them; peers verify PDSERVE_TLS_SERVER_NAME, not the pod IP.
- name: PDSERVE_TLS_CERT
  value: /etc/pdserve/tls/tls.crt
- name: PDSERVE_TLS_KEY
  value: /etc/pdserve/tls/tls.key
- name: PDSERVE_TLS_CA
  value: {{ ternary (printf "/etc/pdserve/tls-ca/%s" $v.tls.trustBundle.key) "/etc/pdserve/tls/ca.crt" (ne $v.tls.trustBundle.configMapName "") | quote }}
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ $v.tls.serverName | quote }}
{{- end }}
{{- if include "pdserve.healthOn" . }}
# Plain grpc.health.v1 only, for kubelet's probes (they present no client certificate).
- name: PDSERVE_HEALTH_PORT
  value: {{ include "pdserve.healthPort" . | quote }}
{{- end }}
{{- end -}}

{{/* The port the probes use: health where it is on, else the gRPC port.
(dict "root" . "component" "decode") */}}
{{- define "pdserve.probePort" -}}
{{- if include "pdserve.healthOn" . -}}
{{- include "pdserve.healthPort" . -}}
{{- else -}}
{{- (index .root.Values .component).port | int -}}
{{- end -}}
{{- end -}}
