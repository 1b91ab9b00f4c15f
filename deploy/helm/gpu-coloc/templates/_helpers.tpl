{{/*
Names. Everything the chart creates is named after the release ("fullname"), cluster-scoped
objects (PriorityClasses, ClusterRoles, webhook configurations) included, so that two
releases never collide. `app.kubernetes.io/name` stays gpu-coloc-agent / gpu-coloc-webhook
whatever the release: ServiceMonitors use it as the `job` label, which the alerts and the
dashboard select on.
*/}}
{{- define "gpu-coloc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-coloc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The mutating webhook configuration sorts first among mutating configurations: the API
server calls them in the order of their names, and HAMi's (reinvocationPolicy Never) must
see the requests gpu-coloc's translation writes (the `hami` backend). A leading "00-" puts
it before any name that starts with a letter, whatever the two releases are called.
*/}}
{{- define "gpu-coloc.mutatingName" -}}{{ printf "00-%s" (include "gpu-coloc.webhook" .) | trunc 63 | trimSuffix "-" }}{{- end }}

{{- define "gpu-coloc.agent" -}}{{ include "gpu-coloc.fullname" . | trunc 57 | trimSuffix "-" }}-agent{{- end }}
{{- define "gpu-coloc.webhook" -}}{{ include "gpu-coloc.fullname" . | trunc 55 | trimSuffix "-" }}-webhook{{- end }}

{{/* The PriorityClass the webhook gives offline pods: named per release unless set. */}}
{{- define "gpu-coloc.offlinePriorityClass" -}}
{{- default (printf "%s-offline" (include "gpu-coloc.fullname" . | trunc 55 | trimSuffix "-")) .Values.offlinePriorityClass.name }}
{{- end }}
{{- define "gpu-coloc.agentPriorityClass" -}}
{{- default (include "gpu-coloc.agent" .) .Values.agent.priorityClass.name }}
{{- end }}

{{- define "gpu-coloc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-coloc
{{- end }}

{{/* Common labels plus the instance, for objects without a component selector. */}}
{{- define "gpu-coloc.releaseLabels" -}}
{{ include "gpu-coloc.labels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpu-coloc.agentSelector" -}}
app.kubernetes.io/name: gpu-coloc-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
{{- define "gpu-coloc.webhookSelector" -}}
app.kubernetes.io/name: gpu-coloc-webhook
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* registry/repository:tag; global.imageRegistry (a parent chart's) wins over image.registry. */}}
{{- define "gpu-coloc.image" -}}
{{- $img := index .Values.image .component -}}
{{- $registry := default .Values.image.registry ((.Values.global | default dict).imageRegistry) -}}
{{- $repo := ternary (printf "%s/%s" $registry $img.repository) $img.repository (ne $registry "") -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion $img.tag) }}
{{- end }}

{{/*
GPU nodes as each stack labels them (agent.gpuNodes): one nodeSelectorTerm per label, ORed.
*/}}
{{- define "gpu-coloc.gpuNodeLabels" -}}
{{- $by := dict
  "gpu-operator" (list (list "nvidia.com/gpu.present" "true"))
  "hami" (list (list "gpu" "on"))
  "device-plugin" (list (list "feature.node.kubernetes.io/pci-10de.present" "true") (list "gpu-coloc.dev/gpu" "true"))
  "custom" (list) }}
{{- $_ := set $by "auto" (concat (get $by "gpu-operator") (get $by "hami") (get $by "device-plugin")) }}
{{- toJson (get $by .Values.agent.gpuNodes) }}
{{- end }}

{{/*
The agent pod's affinity: agent.affinity, plus the GPU nodes of agent.gpuNodes (unless
agent.affinity has a nodeAffinity of its own), plus one release's agent per node: two
agents on one node would fight over the same GPUs and the same state directory, so another
release's agent pod stays Pending there ("didn't match pod anti-affinity rules").
*/}}
{{- define "gpu-coloc.agentAffinity" -}}
{{- $aff := deepCopy (.Values.agent.affinity | default dict) }}
{{- $labels := include "gpu-coloc.gpuNodeLabels" . | fromJsonArray }}
{{- if and (not (hasKey $aff "nodeAffinity")) $labels }}
{{- $terms := list }}
{{- range $labels }}
{{- $terms = append $terms (dict "matchExpressions" (list (dict "key" (index . 0) "operator" "In" "values" (list (index . 1))))) }}
{{- end }}
{{- $_ := set $aff "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms)) }}
{{- end }}
{{- $paa := deepCopy (get $aff "podAntiAffinity" | default dict) }}
{{- $one := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchExpressions" (list
  (dict "key" "app.kubernetes.io/name" "operator" "In" "values" (list "gpu-coloc-agent"))
  (dict "key" "app.kubernetes.io/instance" "operator" "NotIn" "values" (list .Release.Name)))) }}
{{- $_ := set $paa "requiredDuringSchedulingIgnoredDuringExecution" (append (get $paa "requiredDuringSchedulingIgnoredDuringExecution" | default list) $one) }}
{{- $_ := set $aff "podAntiAffinity" $paa }}
{{- toYaml $aff }}
{{- end }}

{{/*
Whether the agent calls the CUDA driver's checkpoint API (agent.driverLock, memoryPreemption):
it then needs the driver library (libcuda.so.1) and capabilities SYS_PTRACE and DAC_OVERRIDE,
and so does its resume-guard, which restores and unlocks what a killed agent left. "true" or "".
*/}}
{{- define "gpu-coloc.usesDriver" -}}
{{- if or .Values.agent.driverLock .Values.memoryPreemption.enabled }}true{{ end }}
{{- end }}

{{/*
A duration as humantime writes it (the schema's pattern: 500us, 2s, 1m30s, 1h), in ms.
*/}}
{{- define "gpu-coloc.durationMs" -}}
{{- $unit := dict "ns" 0.000001 "nsec" 0.000001 "us" 0.001 "usec" 0.001 "µs" 0.001 "ms" 1 "msec" 1
  "s" 1000 "sec" 1000 "secs" 1000 "second" 1000 "seconds" 1000
  "m" 60000 "min" 60000 "mins" 60000 "minute" 60000 "minutes" 60000
  "h" 3600000 "hr" 3600000 "hrs" 3600000 "hour" 3600000 "hours" 3600000 }}
{{- $ms := 0.0 }}
{{- range regexFindAll "[0-9]+ ?[a-zµ]+" (toString .) -1 }}
{{- $n := regexFind "^[0-9]+" . }}
{{- $ms = addf $ms (mulf (float64 $n) (get $unit (trimPrefix $n . | trim))) }}
{{- end }}
{{- $ms }}
{{- end }}

{{/* TLS for the webhook: certManager, or the bootstrap Job, or a caBundle given by hand. */}}
{{- define "gpu-coloc.tlsMode" -}}
{{- if .Values.webhook.certManager.enabled }}cert-manager{{ else if .Values.webhook.caBundle }}manual{{ else }}bootstrap{{ end }}
{{- end }}

{{/*
Which pods the webhooks review: only those that ask for mGPU (a vke.volcengine.com/*
request in a container or init container) or carry the webhook's record of one. For an
UPDATE, the old pod's record counts too (removing it is refused). CEL, Kubernetes >= 1.30.
*/}}
{{- define "gpu-coloc.asksForMgpu" -}}
(has({{ . }}.metadata.annotations) && ('gpu-coloc.dev/requested' in {{ . }}.metadata.annotations || 'gpu-coloc.dev/requests' in {{ . }}.metadata.annotations))
{{- range $list := list "containers" "initContainers" }} ||
(has({{ $ }}.spec.{{ $list }}) && {{ $ }}.spec.{{ $list }}.exists(c, has(c.resources) && (
(has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('vke.volcengine.com/'))) ||
(has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('vke.volcengine.com/'))))))
{{- end }}
{{- end }}

{{/*
Which pods /inject sees at CREATE: those that ask for a GPU resource (nvidia.com/gpu or its
shared replicas, HAMi's gpucores/gpumem, mGPU; not MIG, which the agent does not manage), carry the mGPU record, or name
a DRA resource claim with the annotation gpu-coloc.dev/shim: enabled. The webhook itself
decides the class. CEL, Kubernetes >= 1.30.
*/}}
{{- define "gpu-coloc.asksForGpu" -}}
{{- include "gpu-coloc.asksForMgpu" "object" }}
{{- range $list := list "containers" "initContainers" }} ||
(has(object.spec.{{ $list }}) && object.spec.{{ $list }}.exists(c, has(c.resources) && (
(has(c.resources.limits) && c.resources.limits.exists(k, k in ['nvidia.com/gpu', 'nvidia.com/gpu.shared', 'nvidia.com/gpucores', 'nvidia.com/gpumem', 'nvidia.com/gpumem-percentage'])) ||
(has(c.resources.requests) && c.resources.requests.exists(k, k in ['nvidia.com/gpu', 'nvidia.com/gpu.shared', 'nvidia.com/gpucores', 'nvidia.com/gpumem', 'nvidia.com/gpumem-percentage'])) ||
(has(c.resources.claims) && size(c.resources.claims) > 0 && has(object.metadata.annotations) && 'gpu-coloc.dev/shim' in object.metadata.annotations && object.metadata.annotations['gpu-coloc.dev/shim'] == 'enabled'))))
{{- end }}
{{- end }}

{{- define "gpu-coloc.matchConditions" -}}
- name: asks-for-mgpu
  expression: |-
    {{- include "gpu-coloc.asksForMgpu" "object" | nindent 4 }} ||
    (request.operation == 'UPDATE' && (
    {{- include "gpu-coloc.asksForMgpu" "oldObject" | nindent 4 }}))
{{- end }}

{{/*
Which pods /validate-mounts sees: those with a hostPath volume or a volume named like the
injected ones (gpu-coloc-*); at CREATE and when ephemeral containers are added (the pod's
volumes are then those it was created with).
*/}}
{{- define "gpu-coloc.hostOrOurVolumes" -}}
has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.hostPath) || v.name.startsWith('gpu-coloc-'))
{{- end }}

{{/* Namespaces no webhook looks at: kube-system, the release's own, the opted-out. */}}
{{- define "gpu-coloc.namespaceExclusions" -}}
- key: kubernetes.io/metadata.name
  operator: NotIn
  values: {{ concat (list "kube-system" .Release.Namespace) .Values.webhook.excludeNamespaces | uniq | toJson }}
- key: gpu-coloc.dev/webhook
  operator: NotIn
  values: ["disabled"]
{{- end }}

{{/* The webhook's settings file (its ConfigMap; a change rolls the Deployment). */}}
{{- define "gpu-coloc.webhookConfig" -}}
backend = {{ .Values.webhook.backend | quote }}
{{- if .Values.offlinePriorityClass.enabled }}
# The class, its value and its preemption policy go into the pod together: the API
# server's Priority plugin refuses a pod whose spec.priority is not its class's value.
offline_priority_class = {{ include "gpu-coloc.offlinePriorityClass" . | quote }}
offline_priority = {{ int .Values.offlinePriorityClass.value }}
offline_preemption_policy = "Never"
{{- end }}
# /validate-mounts: host directories no pod may mount writable (besides the [shim] ones):
# the agent's fail-open record.
protected_host_paths = [{{ .Values.agent.stateDir | quote }}]
{{- with .Values.classes }}
{{- if or .offlinePriorityClasses (not (kindIs "invalid" .offlinePriorityBelow)) }}
# The PriorityClass mapping (the agent's COLOC_OFFLINE_PRIORITY_CLASS/_BELOW say the same).
[classes]
offline_priority_classes = {{ .offlinePriorityClasses | default list | toJson }}
{{- if not (kindIs "invalid" .offlinePriorityBelow) }}
offline_priority_below = {{ int .offlinePriorityBelow }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.shim.enabled }}
# /inject: the CUDA shim into GPU pods (the same paths the agent's pods use on the nodes).
[shim]
library = {{ .Values.shim.library | quote }}
doorbell_dir = {{ .Values.shim.doorbellDir | quote }}
gate_dir = {{ .Values.shim.gateDir | quote }}
{{- if ne .Values.shim.delivery "hostPath" }}
# A slot of the agent's device plugin per GPU container, no hostPath in the pod.
delivery = "device"
{{- end }}
{{- if not (kindIs "invalid" .Values.shim.inflight) }}
inflight = {{ int .Values.shim.inflight }}
{{- end }}
{{- if not (kindIs "invalid" .Values.shim.inflightMs) }}
inflight_ms = {{ float64 .Values.shim.inflightMs }}
{{- end }}
{{- if .Values.shim.learnedRelease }}
online_wake_gap_ms = {{ float64 .Values.shim.releaseFloorMs }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Where the webhook's pods and the certificate hook Jobs run: webhook.nodeSelector,
tolerations, priorityClassName, and affinity (default for the Deployment: replicas spread
over nodes, preferred). `.spread`: add that default.
*/}}
{{- define "gpu-coloc.webhookScheduling" -}}
{{- $w := .Values.webhook }}
{{- with $w.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $w.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $w.affinity }}
affinity:
  {{- toYaml $w.affinity | nindent 2 }}
{{- else if .spread }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "gpu-coloc.webhookSelector" . | nindent 14 }}
{{- end }}
{{- end }}
