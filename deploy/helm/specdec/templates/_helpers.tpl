{{/* ---------- names and labels ---------- */}}

{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept to 45 characters so "<fullname>-target-<n>" and StatefulSet revision labels stay within 63. */}}
{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Standard labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end -}}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference; call with (dict "root" $ "image" .Values.image). */}}
{{- define "specdec.imageRef" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The image for draft and target: the CUDA image on GPUs, the slim one on CPU. */}}
{{- define "specdec.modelImage" -}}
{{- if eq .Values.device "cuda" -}}{{ .Values.cudaImage | toYaml }}{{- else -}}{{ .Values.image | toYaml }}{{- end -}}
{{- end -}}

{{/* ---------- addresses ---------- */}}

{{/* "true" when the target serves a verify lane: target.verifyLanePort set, a target container (not pairing=colocated),
plaintext (the lane has no TLS). */}}
{{- define "specdec.verifyLane" -}}
{{- if and .Values.target.verifyLanePort (ne .Values.pairing "colocated") (not .Values.tls.enabled) -}}true{{- end -}}
{{- end -}}

{{/* Headless Service names (the StatefulSets' serviceName). */}}
{{- define "specdec.pairService" -}}{{ include "specdec.fullname" . }}-pair{{- end -}}
{{- define "specdec.draftService" -}}{{ include "specdec.fullname" . }}-draft{{- end -}}
{{- define "specdec.targetService" -}}{{ include "specdec.fullname" . }}-target{{- end -}}
{{- define "specdec.gatewayService" -}}{{ include "specdec.fullname" . }}-gateway{{- end -}}

{{/* DNS suffix for pods of a headless Service; call with (dict "root" $ "service" NAME). */}}
{{- define "specdec.podDomain" -}}
{{- printf "%s.%s.svc.%s" .service .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* One --pair DRAFT=TARGET value per pair replica, as YAML list items of args. */}}
{{- define "specdec.gatewayPairArgs" -}}
{{- $root := . -}}
{{- range $i := until (int .Values.pairs.replicas) }}
{{- if eq $root.Values.pairing "split" }}
{{- $d := include "specdec.podDomain" (dict "root" $root "service" (include "specdec.draftService" $root)) }}
{{- $t := include "specdec.podDomain" (dict "root" $root "service" (include "specdec.targetService" $root)) }}
- --pair={{ include "specdec.draftService" $root }}-{{ $i }}.{{ $d }}:{{ $root.Values.draft.port }}={{ include "specdec.targetService" $root }}-{{ $i }}.{{ $t }}:{{ $root.Values.target.port }}
{{- else }}
{{- $host := printf "%s-%d.%s" (include "specdec.pairService" $root) $i (include "specdec.podDomain" (dict "root" $root "service" (include "specdec.pairService" $root))) }}
{{- $targetPort := ternary $root.Values.draft.port $root.Values.target.port (eq $root.Values.pairing "colocated") }}
- --pair={{ $host }}:{{ $root.Values.draft.port }}={{ $host }}:{{ $targetPort }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ---------- models ---------- */}}

{{- define "specdec.modelRoot" -}}
{{- if eq .Values.models.source "bundled" -}}/opt/specdec/models/tiny-code{{- else -}}/models{{- end -}}
{{- end -}}
{{- define "specdec.targetModelDir" -}}{{ include "specdec.modelRoot" . }}/{{ .Values.models.targetDir }}{{- end -}}
{{- define "specdec.draftModelDir" -}}{{ include "specdec.modelRoot" . }}/{{ .Values.models.draftDir }}{{- end -}}

{{- define "specdec.modelClaimName" -}}
{{- default (printf "%s-models" (include "specdec.fullname" .)) .Values.models.pvc.existingClaim -}}
{{- end -}}

{{/* The weights volume (list item), if any. */}}
{{- define "specdec.modelVolume" -}}
{{- $m := .Values.models -}}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "specdec.modelClaimName" . }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "image" }}
- name: models
  emptyDir:
    {{- with $m.image.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "specdec.modelMount" -}}
{{- if ne .Values.models.source "bundled" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{/* Init container that copies weights out of an image (models.source=image). */}}
{{- define "specdec.modelInitContainers" -}}
{{- $m := .Values.models -}}
{{- if eq $m.source "image" }}
initContainers:
  - name: copy-models
    image: {{ printf "%s:%s" $m.image.repository $m.image.tag | quote }}
    imagePullPolicy: {{ $m.image.pullPolicy }}
    {{- if $m.image.command }}
    command: {{- toYaml $m.image.command | nindent 6 }}
    {{- else }}
    command: ["cp", "-R", "{{ $m.image.sourcePath }}/.", "/mnt/models/"]
    {{- end }}
    securityContext: {{- toYaml .Values.securityContext | nindent 6 }}
    resources: {{- toYaml $m.image.resources | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /mnt/models
{{- end }}
{{- end -}}

{{/* ---------- shared container pieces ---------- */}}

{{/* Env for every specdec container; call with (dict "root" $ "service" "specdec-gateway"). */}}
{{- define "specdec.commonEnv" -}}
{{- $v := .root.Values -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: OTEL_SERVICE_NAME
  value: {{ .service }}
{{- if $v.tracing.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ include "specdec.otlpEndpoint" .root | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $v.tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $v.tracing.samplerArg | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "service.namespace=$(POD_NAMESPACE),service.instance.id=$(POD_NAME),k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end -}}

{{- define "specdec.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else -}}
{{- printf "http://%s-jaeger:4317" (include "specdec.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* `--<prefix>tls-cert/-key[/-ca]` from the mounted Secret when TLS is on; call with (dict "root" $ "prefix" "")
     for a server's own flags, "target-" for the draft's flags towards its target. A client presents the same
     certificate (needed when tls.ca makes the servers require one) and verifies with ca.crt. */}}
{{- define "specdec.tlsArgs" -}}
{{- $tls := .root.Values.tls -}}
{{- if $tls.enabled }}
- --{{ .prefix }}tls-cert=/etc/specdec/tls/tls.crt
- --{{ .prefix }}tls-key=/etc/specdec/tls/tls.key
{{- if $tls.ca }}
- --{{ .prefix }}tls-ca=/etc/specdec/tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{/* The API-key file as the gateway and the helm-test client see it (the Secret mounted at /etc/specdec/api-key). */}}
{{- define "specdec.apiKeyFile" -}}
/etc/specdec/api-key/{{ .Values.gateway.apiKey.secretKey }}
{{- end -}}

{{- define "specdec.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/specdec/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "specdec.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* startup/readiness/liveness probes; call with (dict "root" $ "port" P "service" NAME "cfg" .Values.X), and
"live" NAME2 where startup and liveness ask another health name than readiness (the gateway's "liveness"). */}}
{{- define "specdec.probes" -}}
{{- $ctx := . -}}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{ $kind }}:
  {{- $name := ternary $ctx.service (default $ctx.service $ctx.live) (eq $kind "readinessProbe") }}
  {{- include "specdec.probeHandler" (merge (dict "service" $name) $ctx) | nindent 2 }}
  {{- $probe := deepCopy (get $ctx.cfg $kind) }}
  {{- if and (eq $kind "startupProbe") $ctx.minStartupS }}
  {{- /* at least minStartupS seconds: a draft's start includes its wait for its target (--target-wait-seconds) */}}
  {{- $period := int (default 10 $probe.periodSeconds) }}
  {{- $_ := set $probe "failureThreshold" (max (int (default 3 $probe.failureThreshold)) (div (add (int $ctx.minStartupS) $period -1) $period)) }}
  {{- end }}
  {{- toYaml $probe | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "specdec.probeHandler" -}}
{{- $tls := .root.Values.tls -}}
{{- if $tls.enabled -}}
exec:
  command:
    - python
    - /opt/specdec/healthcheck.py
    - --addr=localhost:{{ .port }}
    - --service={{ .service }}
    {{- include "specdec.tlsArgs" (dict "root" .root "prefix" "") | trim | nindent 4 }}
    - --server-name={{ $tls.healthServerName }}
{{- else -}}
grpc:
  port: {{ .port }}
  service: {{ .service }}
{{- end -}}
{{- end -}}

{{- define "specdec.lifecycle" -}}
{{- if gt (int .Values.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.preStopSleepSeconds }}
{{- end }}
{{- end -}}

{{- define "specdec.terminationGracePeriodSeconds" -}}
{{- add .Values.preStopSleepSeconds .Values.drainSeconds .Values.terminationGraceMarginSeconds -}}
{{- end -}}

{{/* Resources, plus nvidia.com/gpu on GPUs; call with (dict "root" $ "cfg" .Values.draft). */}}
{{- define "specdec.modelResources" -}}
{{- $res := deepCopy (default dict .cfg.resources) -}}
{{- if eq .root.Values.device "cuda" -}}
{{- $limits := default dict $res.limits -}}
{{- $requests := default dict $res.requests -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .cfg.gpus) -}}
{{- $_ := set $requests "nvidia.com/gpu" (int .cfg.gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "specdec.optionalFlag" -}}
{{- if not (kindIs "invalid" .value) }}{{ if ne (toString .value) "" }}
- --{{ .flag }}={{ .value }}
{{- end }}{{ end }}
{{- end -}}

{{/* --attention-backend for a service: its value, else flashinfer on GPUs (the CUDA image has it; the CUDA graphs
     need it), else the service default (torch). Call with (dict "value" $v.target.attentionBackend "device" $v.device) */}}
{{- define "specdec.attentionBackend" -}}
{{- $backend := .value | default (ternary "flashinfer" "" (eq .device "cuda")) }}
{{- if $backend }}
- --attention-backend={{ $backend }}
{{- end }}
{{- end -}}

{{/* ---------- the draft and target containers (shared by pair and split modes) ---------- */}}

{{/* call with (dict "root" $ "targetAddr" "localhost:50052" "extraEnv" LIST); targetAddr "in-process" (pairing
     colocated): the container runs the target too, sized by the target's KV values, and serves TargetService */}}
{{- define "specdec.draftContainer" -}}
{{- $v := .root.Values -}}
{{- $colocated := eq .targetAddr "in-process" -}}
{{- $img := include "specdec.modelImage" .root | fromYaml -}}
- name: draft
  image: {{ include "specdec.imageRef" (dict "root" .root "image" $img) | quote }}
  imagePullPolicy: {{ $img.pullPolicy }}
  args:
    - serve-draft
    - --model={{ include "specdec.draftModelDir" .root }}
    - --target-model={{ include "specdec.targetModelDir" .root }}
    - --target={{ .targetAddr }}
    - {{ printf "--host=%s" $v.listenHost | quote }}
    - --port={{ $v.draft.port }}
    - --metrics-port={{ $v.draft.metricsPort }}
    - --device={{ $v.device }}
    {{- with include "specdec.optionalFlag" (dict "flag" "dtype" "value" $v.draft.dtype) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.attentionBackend" (dict "value" $v.draft.attentionBackend "device" $v.device) | trim }}{{ . | nindent 4 }}{{- end }}
    - --num-steps={{ $v.draft.numSteps }}
    - --topk={{ $v.draft.topk }}
    - --num-draft-tokens={{ $v.draft.numDraftTokens }}
    {{- /* the pair's batch: the draft's scheduler decides what each Verify carries (null: the target's value) */}}
    {{- with include "specdec.optionalFlag" (dict "flag" "max-batch-size" "value" (ternary $v.target.maxBatchSize $v.draft.maxBatchSize (kindIs "invalid" $v.draft.maxBatchSize))) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- if not $colocated }}
    - --target-wait-seconds={{ include "specdec.targetWaitSeconds" .root }}
    {{- end }}
    {{- if and (eq $v.device "cuda") (not $v.draft.cudaGraph) }}
    - --disable-cuda-graph
    {{- end }}
    {{- if $colocated }}
    {{- with include "specdec.optionalFlag" (dict "flag" "page-size" "value" $v.target.pageSize) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "num-pages" "value" $v.target.numPages) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "prefill-chunk-tokens" "value" $v.target.prefillChunkTokens) | trim }}{{ . | nindent 4 }}{{- end }}
    - --request-idle-seconds={{ $v.target.requestIdleSeconds }}
    {{- else if eq $v.device "cuda" }}
    - --two-batch-overlap={{ $v.draft.twoBatchOverlap }}
    {{- end }}
    {{- if not $colocated }}
    - --feature-wire={{ $v.draft.featureWire }}
    {{- end }}
    {{- with $v.models.tokenMapFile }}
    - --token-map={{ include "specdec.modelRoot" $.root }}/{{ . }}
    {{- end }}
    - --prompt-feature-mb={{ $v.draft.promptFeatureMb }}
    - --admission-gather-ms={{ $v.draft.admissionGatherMs }}
    - --plain-calls-in-flight={{ $v.draft.plainCallsInFlight }}
    - --speculation={{ $v.draft.speculation }}
    {{- with include "specdec.optionalFlag" (dict "flag" "plain-steps" "value" $v.draft.plainSteps) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "calibration-max-batch" "value" $v.draft.calibrationMaxBatch) | trim }}{{ . | nindent 4 }}{{- end }}
    - --log-format={{ $v.logFormat }}
    - --drain-seconds={{ $v.drainSeconds }}
    - --engine-stall-seconds={{ $v.engineStallSeconds }}
    {{- with include "specdec.tlsArgs" (dict "root" .root "prefix" "") | trim }}{{ . | nindent 4 }}{{- end }}
    {{- if not $colocated }}
    {{- with include "specdec.tlsArgs" (dict "root" .root "prefix" "target-") | trim }}{{ . | nindent 4 }}{{- end }}
    {{- end }}
    {{- with $v.draft.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- with include "specdec.commonEnv" (dict "root" .root "service" "specdec-draft") | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with .extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $v.draft.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: grpc-draft, containerPort: {{ $v.draft.port }}, protocol: TCP}
    - {name: metrics-draft, containerPort: {{ $v.draft.metricsPort }}, protocol: TCP}
  {{- /* ready while its target answers and fits it; alive (startup, liveness) once loaded, whatever its target does */}}
  {{- /* a draft's start waits for its target up to draft.targetWaitSeconds, then loads, calibrates and captures its
         own graphs (600 s allowed): its startup probe allows both */}}
  {{- $minStart := ternary 0 (add (include "specdec.targetWaitSeconds" .root | atoi) 600) $colocated }}
  {{- with include "specdec.probes" (dict "root" .root "port" $v.draft.port "service" "specdec.v1.DraftService" "live" "liveness" "cfg" $v.draft "minStartupS" $minStart) | trim }}{{ . | nindent 2 }}{{- end }}
  {{- with include "specdec.lifecycle" .root | trim }}{{ . | nindent 2 }}{{- end }}
  resources: {{- include "specdec.modelResources" (dict "root" .root "cfg" $v.draft) | nindent 4 }}
  securityContext: {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - {name: tmp-draft, mountPath: /tmp}
    {{- with include "specdec.modelMount" .root | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.tlsMount" .root | trim }}{{ . | nindent 4 }}{{- end }}
    {{- if $v.pairs.shmSizeLimit }}
    - {name: dshm, mountPath: /dev/shm}
    {{- end }}
{{- end -}}

{{/* call with (dict "root" $) */}}
{{- define "specdec.targetContainer" -}}
{{- $v := .root.Values -}}
{{- $img := include "specdec.modelImage" .root | fromYaml -}}
- name: target
  image: {{ include "specdec.imageRef" (dict "root" .root "image" $img) | quote }}
  imagePullPolicy: {{ $img.pullPolicy }}
  args:
    - serve-target
    - --model={{ include "specdec.targetModelDir" .root }}
    - {{ printf "--host=%s" $v.listenHost | quote }}
    - --port={{ $v.target.port }}
    - --metrics-port={{ $v.target.metricsPort }}
    {{- if include "specdec.verifyLane" .root }}
    - --verify-lane-port={{ $v.target.verifyLanePort }}
    {{- end }}
    - --device={{ $v.device }}
    {{- with include "specdec.optionalFlag" (dict "flag" "dtype" "value" $v.target.dtype) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.attentionBackend" (dict "value" $v.target.attentionBackend "device" $v.device) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "page-size" "value" $v.target.pageSize) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "num-pages" "value" $v.target.numPages) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "max-batch-size" "value" $v.target.maxBatchSize) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "plain-steps" "value" $v.target.plainSteps) | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.optionalFlag" (dict "flag" "prefill-chunk-tokens" "value" $v.target.prefillChunkTokens) | trim }}{{ . | nindent 4 }}{{- end }}
    - --request-idle-seconds={{ $v.target.requestIdleSeconds }}
    {{- if and (eq $v.device "cuda") (not $v.target.cudaGraph) }}
    - --disable-cuda-graph
    {{- end }}
    - --log-format={{ $v.logFormat }}
    - --drain-seconds={{ $v.drainSeconds }}
    - --engine-stall-seconds={{ $v.engineStallSeconds }}
    {{- with include "specdec.tlsArgs" (dict "root" .root "prefix" "") | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with $v.target.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- with include "specdec.commonEnv" (dict "root" .root "service" "specdec-target") | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with $v.target.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: grpc-target, containerPort: {{ $v.target.port }}, protocol: TCP}
    - {name: metrics-target, containerPort: {{ $v.target.metricsPort }}, protocol: TCP}
    {{- if include "specdec.verifyLane" .root }}
    - {name: lane-target, containerPort: {{ $v.target.verifyLanePort }}, protocol: TCP}
    {{- end }}
  {{- with include "specdec.probes" (dict "root" .root "port" $v.target.port "service" "specdec.v1.TargetService" "cfg" $v.target) | trim }}{{ . | nindent 2 }}{{- end }}
  {{- with include "specdec.lifecycle" .root | trim }}{{ . | nindent 2 }}{{- end }}
  resources: {{- include "specdec.modelResources" (dict "root" .root "cfg" $v.target) | nindent 4 }}
  securityContext: {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - {name: tmp-target, mountPath: /tmp}
    {{- with include "specdec.modelMount" .root | trim }}{{ . | nindent 4 }}{{- end }}
    {{- with include "specdec.tlsMount" .root | trim }}{{ . | nindent 4 }}{{- end }}
    {{- if $v.pairs.shmSizeLimit }}
    - {name: dshm, mountPath: /dev/shm}
    {{- end }}
{{- end -}}

{{/* Pod-level settings shared by pair, draft and target pods. */}}
{{- define "specdec.pairPodSpec" -}}
{{- $v := .Values -}}
serviceAccountName: {{ include "specdec.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ include "specdec.terminationGracePeriodSeconds" . }}
securityContext: {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.pairs.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.pairs.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $v.pairs.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.pairs.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.pairs.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.pairs.topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Volumes for a pod running the given containers; call with (dict "root" $ "tmp" (list "tmp-draft")). */}}
{{- define "specdec.pairVolumes" -}}
{{- $v := .root.Values -}}
volumes:
  {{- range .tmp }}
  - name: {{ . }}
    emptyDir: {sizeLimit: {{ $v.tmpSizeLimit }}}
  {{- end }}
  {{- with include "specdec.modelVolume" .root | trim }}{{ . | nindent 2 }}{{- end }}
  {{- with include "specdec.tlsVolume" .root | trim }}{{ . | nindent 2 }}{{- end }}
  {{- if $v.pairs.shmSizeLimit }}
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ $v.pairs.shmSizeLimit }}}
  {{- end }}
{{- end -}}

{{/* How long a draft waits for its target at start: draft.targetWaitSeconds, else the target's start-up budget
     (its startup probe's periodSeconds * failureThreshold), so a target given longer to load is waited for
     that long (QA: the draft gave up at 30 minutes and restarted with back-off). */}}
{{- define "specdec.targetWaitSeconds" -}}
{{- $v := .Values -}}
{{- if kindIs "invalid" $v.draft.targetWaitSeconds -}}
{{- mul $v.target.startupProbe.periodSeconds $v.target.startupProbe.failureThreshold -}}
{{- else -}}
{{- $v.draft.targetWaitSeconds -}}
{{- end -}}
{{- end -}}

{{/* values.yaml's defaults of target.resources and target's probes (tests/deploy checks they agree): with
     pairing=colocated a target value other than these, and other than the draft's, would be dropped. */}}
{{- define "specdec.targetPodDefaults" -}}
resources:
  requests: {cpu: 500m, memory: 1Gi}
  limits: {memory: 4Gi}
startupProbe: {periodSeconds: 10, failureThreshold: 180, timeoutSeconds: 5}
readinessProbe: {periodSeconds: 5, failureThreshold: 2, timeoutSeconds: 5}
livenessProbe: {periodSeconds: 10, failureThreshold: 6, timeoutSeconds: 5}
{{- end -}}

{{/* ---------- checks that the schema cannot express ---------- */}}
{{- define "specdec.validate" -}}
{{- $v := .Values -}}
{{- if and (eq $v.pairing "colocated") (ne $v.draft.featureWire "native") -}}
{{- fail "pairing=colocated keeps the features on the GPU: draft.featureWire must be native" -}}
{{- end -}}
{{- if eq $v.pairing "colocated" -}}
{{- /* one process runs both models with the draft container's flags: a target setting that would be dropped
       silently is refused instead, naming where it goes */ -}}
{{- $cuda := eq $v.device "cuda" -}}
{{- $backend := ternary "flashinfer" "torch" $cuda -}}
{{- $autoDtype := ternary "bfloat16" "float32" $cuda -}}
{{- $targetDtype := default "auto" $v.target.dtype -}}
{{- $draftDtype := default "auto" $v.draft.dtype -}}
{{- $set := dict "dtype" (and (ne $targetDtype "auto") (ne $targetDtype (ternary $autoDtype $draftDtype (eq $draftDtype "auto"))))
                 "attentionBackend" (and $v.target.attentionBackend (ne $v.target.attentionBackend (default $backend $v.draft.attentionBackend)))
                 "cudaGraph" (and $cuda (not $v.target.cudaGraph) $v.draft.cudaGraph)
                 "maxBatchSize" (and (not (kindIs "invalid" $v.target.maxBatchSize)) (not (kindIs "invalid" $v.draft.maxBatchSize)) (ne (toString $v.target.maxBatchSize) (toString $v.draft.maxBatchSize))) -}}
{{- range $key := list "dtype" "attentionBackend" "cudaGraph" "maxBatchSize" -}}
{{- if get $set $key -}}
{{- fail (printf "pairing=colocated runs the target in the draft's process with the draft's flags: target.%s (%v) differs from draft.%s (%v); set draft.%s for both" $key (get $v.target $key) $key (get $v.draft $key) $key) -}}
{{- end -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.target.plainSteps) -}}
{{- fail (printf "pairing=colocated: the in-process target's Generate commits 4 tokens a step; target.plainSteps (%v) would be dropped (draft.plainSteps sets the draft's plain calls)" $v.target.plainSteps) -}}
{{- end -}}
{{- range $key := list "extraArgs" "extraEnv" -}}
{{- if get $v.target $key -}}
{{- fail (printf "pairing=colocated has no target container: target.%s would be dropped; put them in draft.%s (the draft's process runs both models)" $key $key) -}}
{{- end -}}
{{- end -}}
{{- /* the one container takes draft.resources and draft's probes: a target.resources (e.g. the GPU section's
       `--set target.resources.limits.memory=96Gi`) or a longer target startup probe for a big model would be dropped,
       the container OOM-killed or restarted while it loads the target (QA). The target's own default, or the draft's
       value, renders. */ -}}
{{- $defaults := include "specdec.targetPodDefaults" $ | fromYaml -}}
{{- range $key := list "resources" "startupProbe" "readinessProbe" "livenessProbe" -}}
{{- $set := toJson (get $v.target $key) -}}
{{- if and (ne $set (toJson (get $defaults $key))) (ne $set (toJson (get $v.draft $key))) -}}
{{- fail (printf "pairing=colocated has no target container: target.%s (%s) would be dropped; set draft.%s (the one container loads and runs both models)" $key $set $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- fail "tls.enabled=true needs tls.secretName (a kubernetes.io/tls Secret with tls.crt, tls.key[, ca.crt])" -}}
{{- end -}}
{{- if and $v.gateway.apiKey.enabled (not $v.gateway.apiKey.existingSecret) (not $v.gateway.apiKey.value) -}}
{{- fail "gateway.apiKey.enabled=true needs gateway.apiKey.existingSecret or gateway.apiKey.value" -}}
{{- end -}}
{{- if and (eq $v.models.source "hostPath") (not $v.models.hostPath.path) -}}
{{- fail "models.source=hostPath needs models.hostPath.path" -}}
{{- end -}}
{{- if and (eq $v.models.source "image") (not $v.models.image.repository) -}}
{{- fail "models.source=image needs models.image.repository" -}}
{{- end -}}
{{- if and $v.tracing.enabled (not $v.tracing.otlpEndpoint) (not $v.tracing.jaeger.enabled) -}}
{{- fail "tracing.enabled=true needs tracing.otlpEndpoint or tracing.jaeger.enabled=true" -}}
{{- end -}}
{{- if and $v.tracing.jaeger.enabled (not $v.tracing.enabled) -}}
{{- fail "tracing.jaeger.enabled=true deploys a Jaeger only for tracing.enabled=true (the services send no spans without it): set both" -}}
{{- end -}}
{{- if and (include "specdec.verifyLane" $) (has (toString $v.target.verifyLanePort) (list (toString $v.target.port) (toString $v.target.metricsPort))) -}}
{{- fail (printf "target.verifyLanePort %v is also target.port or target.metricsPort: the lane needs a port of its own (the target refuses to start)" $v.target.verifyLanePort) -}}
{{- end -}}
{{- range $part := list "gateway" "draft" "target" -}}
{{- $p := get $v $part -}}
{{- if eq (toString $p.port) (toString $p.metricsPort) -}}
{{- fail (printf "%s.port and %s.metricsPort are both %v: a service's metrics need a port of their own (the service refuses to start)" $part $part $p.port) -}}
{{- end -}}
{{- end -}}
{{- if ne $v.device "cuda" -}}
{{- range $part := list "draft" "target" -}}
{{- if eq (toString (get $v $part).attentionBackend) "flashinfer" -}}
{{- fail (printf "%s.attentionBackend=flashinfer needs device=cuda (flashinfer runs on NVIDIA GPUs; the CPU image has no flashinfer and the service refuses to start)" $part) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $v.pairing "pair" -}}
{{- /* a pair's two containers share the pod's network: each port once */ -}}
{{- $ports := dict -}}
{{- $names := list "draft.port" "draft.metricsPort" "target.port" "target.metricsPort" -}}
{{- if include "specdec.verifyLane" $ }}{{- $names = append $names "target.verifyLanePort" -}}{{- end -}}
{{- range $name := $names -}}
{{- $parts := splitList "." $name -}}
{{- $port := toString (get (get $v (index $parts 0)) (index $parts 1)) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "pairing=pair runs the draft and the target in one pod (one network): %s and %s are both %s" (get $ports $port) $name $port) -}}
{{- end -}}
{{- $_ := set $ports $port $name -}}
{{- end -}}
{{- end -}}
{{- if and $v.tracing.enabled $v.tracing.otlpEndpoint $v.tracing.jaeger.enabled -}}
{{- fail "tracing.jaeger.enabled=true deploys a Jaeger the services send to only while tracing.otlpEndpoint is empty: set one of the two" -}}
{{- end -}}
{{- $most := add $v.draft.topk (mul (sub $v.draft.numSteps 1) $v.draft.topk $v.draft.topk) -}}
{{- if gt (int $v.draft.numDraftTokens) (int $most) -}}
{{- fail (printf "draft.numDraftTokens %v exceeds what draft.numSteps %v of draft.topk %v can grow (%v): the draft would refuse to start" $v.draft.numDraftTokens $v.draft.numSteps $v.draft.topk $most) -}}
{{- end -}}
{{- if and $v.gateway.autoscaling.enabled (gt (int $v.gateway.autoscaling.minReplicas) (int $v.gateway.autoscaling.maxReplicas)) -}}
{{- fail (printf "gateway.autoscaling.minReplicas %v exceeds maxReplicas %v" $v.gateway.autoscaling.minReplicas $v.gateway.autoscaling.maxReplicas) -}}
{{- end -}}
{{- end -}}
