{{/* A worker pool's Deployment: (dict "root" . "component" "prefill"|"decode") */}}
{{- define "pdserve.workerDeployment" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $role := .component -}}
{{- $pool := index $v $role -}}
{{- $e := $pool.engine -}}
{{- $ep := include "pdserve.expertParallel" . | int -}}
{{- $tp := include "pdserve.tensorParallel" . | int -}}
{{- $kv := include "pdserve.kvOffload" . | fromYaml -}}
{{- $shared := include "pdserve.kvShared" . | fromYaml -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "pdserve.componentLabels" . | nindent 4 }}
spec:
  {{- if not $pool.autoscaling.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  {{- if and $kv.enabled $kv.claimName }}
  # The old pod lets go of the tier's claim before the new one mounts it: two pods never
  # share the folder, and a ReadWriteOnce claim on another node cannot stall the rollout.
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.componentLabels" . | nindent 8 }}
      {{- with $pool.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      automountServiceAccountToken: false
      {{- /* A decode worker first moves its streams to another (up to the drain timeout), then drains. */}}
      terminationGracePeriodSeconds: {{ if eq $role "decode" }}{{ add (include "pdserve.gracePeriod" $root) (int (ceil $root.Values.termination.drainTimeoutSeconds)) }}{{ else }}{{ include "pdserve.gracePeriod" $root }}{{ end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $v.image.pullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "pdserve.affinity" .) }}{{ . | nindent 6 }}{{- end }}
      {{- with (include "pdserve.modelInit" $root) }}{{ . | nindent 6 }}{{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args: [{{ $role | quote }}]
          ports:
            - name: grpc
              containerPort: {{ $pool.port }}
              protocol: TCP
            {{- range $r := untilStep 1 $ep 1 }}
            - name: grpc-ep{{ $r }}
              containerPort: {{ add $pool.port $r }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $v.metrics.port }}
              protocol: TCP
            {{- range $r := untilStep 1 $ep 1 }}
            - name: metrics-ep{{ $r }}
              containerPort: {{ add $v.metrics.port $r }}
              protocol: TCP
            {{- end }}
            {{- if include "pdserve.healthOn" . }}
            {{- $health := include "pdserve.healthPort" . | int }}
            # Plain grpc.health.v1 for kubelet's probes; no Service or NetworkPolicy opens it.
            - name: health
              containerPort: {{ $health }}
              protocol: TCP
            {{- range $r := untilStep 1 $ep 1 }}
            - name: health-ep{{ $r }}
              containerPort: {{ add $health $r }}
              protocol: TCP
            {{- end }}
            {{- end }}
          env:
            # Listen on the pod IP: a prefill worker puts HOST:PORT into its KV handles and
            # decode workers call it back there, so it must be an address other pods reach.
            - name: PDSERVE_HOST
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: PDSERVE_PORT
              value: {{ $pool.port | quote }}
            - name: PDSERVE_WORKER_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: PDSERVE_DEVICE
              value: {{ $pool.device | quote }}
            - name: PDSERVE_DTYPE
              value: {{ $e.dtype | quote }}
            - name: PDSERVE_KV_CACHE_GB
              value: {{ $e.kvCacheGb | quote }}
            - name: PDSERVE_BLOCK_SIZE
              value: {{ $e.blockSize | quote }}
            - name: PDSERVE_MAX_NUM_SEQS
              value: {{ $e.maxNumSeqs | quote }}
            - name: PDSERVE_MAX_NUM_BATCHED_TOKENS
              value: {{ $e.maxNumBatchedTokens | quote }}
            {{- if gt (int $e.maxModelLen) 0 }}
            - name: PDSERVE_MAX_MODEL_LEN
              value: {{ $e.maxModelLen | quote }}
            {{- end }}
            {{- if gt (int $e.threads) 0 }}
            - name: PDSERVE_THREADS
              value: {{ $e.threads | quote }}
            {{- end }}
            {{- if not $e.prefixCaching }}
            - name: PDSERVE_NO_PREFIX_CACHING
              value: "1"
            {{- end }}
            {{- if $kv.enabled }}
            # The disk tier below the KV pool: evicted prefix blocks are written here and read
            # back on a prefix hit (each expert-parallel rank in its own epR subfolder).
            - name: PDSERVE_KV_OFFLOAD_DIR
              value: {{ $kv.mountPath | quote }}
            - name: PDSERVE_KV_OFFLOAD_GB
              value: {{ $kv.sizeGb | quote }}
            {{- end }}
            {{- if $shared.enabled }}
            # The KV tier shared by the workers (kvShared): every cached prefix block is written
            # through to this ReadWriteMany folder and any worker of the model reads it back.
            - name: PDSERVE_KV_SHARED_DIR
              value: {{ $shared.mountPath | quote }}
            - name: PDSERVE_KV_SHARED_GB
              value: {{ $shared.sizeGb | quote }}
            {{- end }}
            {{- if gt $ep 1 }}
            # Mixture of experts: this process is rank 0 and starts ranks 1..N-1 in the
            # container; rank r listens on PDSERVE_PORT + r (grpc-epR) and uses cuda:r.
            - name: PDSERVE_EXPERT_PARALLEL
              value: {{ $ep | quote }}
            {{- end }}
            {{- if gt $tp 1 }}
            # Tensor parallelism: this process is rank 0 and starts ranks 1..N-1 in the
            # container (rank r uses cuda:r); the group is one worker to the coordinator.
            - name: PDSERVE_TENSOR_PARALLEL
              value: {{ $tp | quote }}
            {{- end }}
            {{- if gt (int $pool.redundantExperts) 0 }}
            - name: PDSERVE_REDUNDANT_EXPERTS
              value: {{ $pool.redundantExperts | int | quote }}
            {{- end }}
            - name: PDSERVE_TRANSFER_TIMEOUT
              value: {{ $pool.transferTimeout | quote }}
            {{- if eq $role "prefill" }}
            - name: PDSERVE_KV_LEASE
              value: {{ $pool.kvLease | quote }}
            {{- else }}
            - name: PDSERVE_MAX_PENDING
              value: {{ $pool.maxPending | quote }}
            {{- end }}
            {{- with $v.ucx.tls }}
            - name: UCX_TLS
              value: {{ . | quote }}
            {{- end }}
            {{- with $v.ucx.netDevices }}
            - name: UCX_NET_DEVICES
              value: {{ . | quote }}
            {{- end }}
            {{- with (include "pdserve.envMap" $v.ucx.env) }}{{ . | nindent 12 }}{{- end }}
            {{- with (include "pdserve.tlsEnv" .) }}{{ . | trim | nindent 12 }}{{- end }}
            {{- include "pdserve.commonEnv" $root | nindent 12 }}
            - name: OTEL_SERVICE_NAME
              value: pdserve-{{ $role }}
            {{- with (include "pdserve.envMap" $pool.env) }}{{ . | nindent 12 }}{{- end }}
          {{- include "pdserve.probes" (dict "port" (include "pdserve.probePort" .) "startupProbe" $pool.startupProbe) | nindent 10 }}
          {{- include "pdserve.lifecycle" $root | nindent 10 }}
          resources:
            {{- $res := deepCopy $pool.resources }}
            {{- $requests := $res.requests | default dict }}
            {{- $limits := $res.limits | default dict }}
            {{- if gt (int $pool.gpus) 0 }}
            {{- $gpus := max (int $pool.gpus) $tp }}
            {{- $_ := set $requests "nvidia.com/gpu" $gpus }}
            {{- $_ := set $limits "nvidia.com/gpu" $gpus }}
            {{- end }}
            {{- if $v.rdma.enabled }}
            {{- $_ := set $requests $v.rdma.resourceName $v.rdma.count }}
            {{- $_ := set $limits $v.rdma.resourceName $v.rdma.count }}
            {{- end }}
            {{- with $requests }}
            requests:
              {{- toYaml . | nindent 14 }}
            {{- end }}
            {{- with $limits }}
            limits:
              {{- toYaml . | nindent 14 }}
            {{- end }}
          securityContext:
            {{- $sc := deepCopy $v.containerSecurityContext }}
            {{- if $v.rdma.enabled }}
            {{- $caps := $sc.capabilities | default dict }}
            {{- $_ := set $caps "add" (list "IPC_LOCK") }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" (dict "root" $root "shm" true) | nindent 12 }}
            {{- if $kv.enabled }}
            - name: kv-offload
              mountPath: {{ $kv.mountPath }}
            {{- end }}
            {{- if $shared.enabled }}
            - name: kv-shared
              mountPath: {{ $shared.mountPath }}
            {{- end }}
      volumes:
        {{- include "pdserve.volumes" (dict "root" $root "shm" true) | nindent 8 }}
        {{- if $kv.enabled }}
        - name: kv-offload
          {{- if $kv.claimName }}
          persistentVolumeClaim:
            claimName: {{ $kv.claimName }}
          {{- else }}
          emptyDir:
            {{- with $kv.medium }}
            medium: {{ . }}
            {{- end }}
            sizeLimit: {{ $kv.sizeLimit }}
          {{- end }}
        {{- end }}
        {{- if $shared.enabled }}
        - name: kv-shared
          persistentVolumeClaim:
            claimName: {{ $shared.claimName }}
        {{- end }}
{{- end -}}

{{/* A pool's disk KV tier (kvOffload), checked, as YAML: enabled, mountPath, sizeGb, claimName,
medium, and sizeLimit, the emptyDir's: ceil(sizeGb x 1.1 x expertParallel) GiB (each
expert-parallel rank keeps a tier of sizeGb of its own, in subfolder epR).
(dict "root" . "component" ROLE) */}}
{{- define "pdserve.kvOffload" -}}
{{- $v := .root.Values -}}
{{- $role := .component -}}
{{- $k := (index $v $role).kvOffload | default dict -}}
{{- if $k.enabled -}}
{{- $ep := include "pdserve.expertParallel" . | int -}}
{{- if not (gt (float64 $k.sizeGb) 0.0) -}}
{{- fail (printf "%s.kvOffload.sizeGb must be > 0 (GiB), got %v" $role $k.sizeGb) -}}
{{- end -}}
{{- $path := trimSuffix "/" (toString $k.mountPath) -}}
{{- if not (hasPrefix "/" $path) -}}
{{- fail (printf "%s.kvOffload.mountPath must be an absolute path other than /, got %q" $role (toString $k.mountPath)) -}}
{{- end -}}
{{- $taken := include "pdserve.workerMountPaths" .root | fromJsonArray -}}
{{- if has $path $taken -}}
{{- fail (printf "%s.kvOffload.mountPath %s is already a volume of the pod (%s)" $role $path (join ", " $taken)) -}}
{{- end -}}
{{- $pool := index $v $role -}}
{{- $many := ternary (gt (int $pool.autoscaling.maxReplicas) 1) (gt (int $pool.replicas) 1) (eq $pool.autoscaling.enabled true) -}}
{{- if and $k.claimName $many -}}
{{- fail (printf "%s.kvOffload.claimName %s would be one folder for several %s pods, but each pod's tier keeps its own index and LRU: kvOffload is the pod's own tier, kvShared the one for a folder shared by pods (keep one %s pod: %s.replicas 1, or %s.autoscaling.maxReplicas 1; or leave claimName empty for a per-pod emptyDir)" $role $k.claimName $role $role $role $role) -}}
{{- end }}
enabled: true
mountPath: {{ $path | quote }}
sizeGb: {{ $k.sizeGb }}
claimName: {{ $k.claimName | default "" | quote }}
medium: {{ ($k.emptyDir | default dict).medium | default "" | quote }}
sizeLimit: {{ divf (mulf $k.sizeGb 11 $ep) 10 | ceil | int }}Gi
{{- else -}}
enabled: false
{{- end -}}
{{- end -}}

{{/* The mount paths every worker pod already has (before its KV tiers), as a JSON list. */}}
{{- define "pdserve.workerMountPaths" -}}
{{- $v := .Values -}}
{{- $taken := list "/var/cache/pdserve" "/tmp" "/dev/shm" -}}
{{- if ne $v.model.source "bundled" }}{{ $taken = append $taken (trimSuffix "/" $v.model.mountPath) }}{{ end -}}
{{- if $v.tls.enabled }}{{ $taken = concat $taken (list "/etc/pdserve/tls" "/etc/pdserve/tls-ca") }}{{ end -}}
{{- toJson $taken -}}
{{- end -}}

{{/* The KV tier shared by the worker pods (kvShared), checked, as YAML for one pool: enabled
(kvShared is on and lists this pool), mountPath, sizeGb, claimName. One ReadWriteMany claim
for every listed pool's pods: no replica limit and no Recreate strategy, sharing is the point
(each worker deletes, LRU first, only blocks it knows of, to keep its share within sizeGb).
(dict "root" . "component" ROLE) */}}
{{- define "pdserve.kvShared" -}}
{{- $v := .root.Values -}}
{{- $role := .component -}}
{{- $s := $v.kvShared | default dict -}}
{{- if $s.enabled -}}
{{- if not $s.claimName -}}
{{- fail "kvShared.claimName is required with kvShared.enabled: an existing ReadWriteMany PersistentVolumeClaim, mounted by every worker pod of kvShared.pools" -}}
{{- end -}}
{{- if not (kindIs "slice" $s.pools) -}}
{{- fail (printf "kvShared.pools must be a list of worker pools (prefill, decode), got %v" $s.pools) -}}
{{- end -}}
{{- if not $s.pools -}}
{{- fail "kvShared.pools lists no pool: name prefill, decode or both (or leave kvShared.enabled off)" -}}
{{- end -}}
{{- range $s.pools -}}
{{- if not (has (toString .) (list "prefill" "decode")) -}}
{{- fail (printf "kvShared.pools: %q is not a worker pool (prefill or decode)" (toString .)) -}}
{{- end -}}
{{- end -}}
{{- if not (gt (float64 $s.sizeGb) 0.0) -}}
{{- fail (printf "kvShared.sizeGb must be > 0 (GiB), got %v" $s.sizeGb) -}}
{{- end -}}
{{- $path := trimSuffix "/" (toString $s.mountPath) -}}
{{- if not (hasPrefix "/" $path) -}}
{{- fail (printf "kvShared.mountPath must be an absolute path other than /, got %q" (toString $s.mountPath)) -}}
{{- end -}}
{{- $taken := include "pdserve.workerMountPaths" .root | fromJsonArray -}}
{{- if has $path $taken -}}
{{- fail (printf "kvShared.mountPath %s is already a volume of the pod (%s)" $path (join ", " $taken)) -}}
{{- end -}}
{{- if has $role (toStrings $s.pools) -}}
{{- $kv := include "pdserve.kvOffload" . | fromYaml -}}
{{- if and $kv.enabled (eq $kv.mountPath $path) -}}
{{- fail (printf "kvShared.mountPath %s is %s.kvOffload.mountPath too: the shared tier and the pod's own tier need folders of their own" $path $role) -}}
{{- end -}}
{{- if not (index $v $role).engine.prefixCaching -}}
{{- fail (printf "kvShared holds prefix-cache blocks: %s.engine.prefixCaching must be on (or leave %s out of kvShared.pools)" $role $role) -}}
{{- end }}
enabled: true
mountPath: {{ $path | quote }}
sizeGb: {{ $s.sizeGb }}
claimName: {{ $s.claimName | quote }}
{{- else -}}
enabled: false
{{- end -}}
{{- else -}}
enabled: false
{{- end -}}
{{- end -}}
