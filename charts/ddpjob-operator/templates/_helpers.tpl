{{/*
Helpers shared by every template (also the monitoring ones):
  ddpjob-operator.name                chart name (nameOverride)
  ddpjob-operator.fullname            resource name prefix (fullnameOverride), <= 63 chars
  ddpjob-operator.chart               "<chart>-<version>" for the helm.sh/chart label
  ddpjob-operator.labels              standard labels for every object
  ddpjob-operator.selectorLabels      the immutable subset used in selectors
  ddpjob-operator.serviceAccountName  the operator's ServiceAccount
  ddpjob-operator.image               "<repository>:<tag or appVersion>"
  ddpjob-operator.watchNamespaces     watched namespaces, one per line (empty = all)
*/}}

{{- define "ddpjob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ddpjob-operator.fullname" -}}
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

{{- define "ddpjob-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ddpjob-operator.labels" -}}
helm.sh/chart: {{ include "ddpjob-operator.chart" . }}
{{ include "ddpjob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddpjob
{{- end }}

{{- define "ddpjob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddpjob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ddpjob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddpjob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ddpjob-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Fail early on value combinations that would install a broken or unsafe operator.
*/}}
{{- define "ddpjob-operator.validate" -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is empty: name the operator image (the chart's default is the release's own; see docs/install.md)" }}
{{- end }}
{{- if and .Values.rbac.namespaced (empty .Values.operator.watchNamespaces) }}
{{- fail "rbac.namespaced=true needs operator.watchNamespaces: the namespaces to create Roles in" }}
{{- end }}
{{- if and (not .Values.ha.enabled) (gt (int .Values.replicaCount) 1) }}
{{- fail "replicaCount > 1 needs ha.enabled=true: standalone replicas would all reconcile the same DDPJobs" }}
{{- end }}
{{- if and .Values.ha.enabled (lt (int .Values.replicaCount) 2) }}
{{- fail "ha.enabled=true needs replicaCount >= 2" }}
{{- end }}
{{- if eq (int .Values.operator.metricsPort) (int .Values.operator.healthPort) }}
{{- fail "operator.metricsPort and operator.healthPort must differ" }}
{{- end }}
{{- end }}

{{/*
The RBAC rules the operator needs inside a namespace it watches: exactly the API calls of
ddpjob_operator (cluster/: its I/O, the client and the informers; app/handlers.py: kopf watches) and of kopf itself
(run with scanning disabled, so no CRD or namespace reads). Nothing on secrets, nodes or RBAC.
*/}}
{{- define "ddpjob-operator.namespacedRules" -}}
# The DDPJobs: watched by kopf (list, watch), read fresh once per reconcile pass (get), and
# deleted once ttlSecondsAfterFinished has passed (delete). The operator never edits a spec.
- apiGroups: ["ddpjob.dev"]
  resources: ["ddpjobs"]
  verbs: ["get", "list", "watch", "delete"]
# Status is merge-patched once per reconcile pass.
- apiGroups: ["ddpjob.dev"]
  resources: ["ddpjobs/status"]
  verbs: ["patch"]
# Children carry ownerReferences with blockOwnerDeletion=true to their DDPJob; clusters with the
# OwnerReferencesPermissionEnforcement admission plugin require this to create them.
- apiGroups: ["ddpjob.dev"]
  resources: ["ddpjobs/finalizers"]
  verbs: ["update"]
# One pod per node: watched by kopf, listed by job label, created, deleted for group restarts;
# read (get) after a 409 on create to tell our own pod from one someone else made with our name.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The headless Service that gives pod 0 its stable MASTER_ADDR (garbage collection removes it with
# the job). Read (get) after a 409 to check it is ours and headless, and before each restarted
# group to recreate one that was deleted (nothing watches Services).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
# Gang scheduling (spec.scheduling.gang): the scheduler's PodGroup, created like the Service and
# read while the gang waits (its status feeds the GangScheduled condition). Rules for an API
# group that the cluster does not serve are harmless.
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create"]
# core/v1 Events on DDPJobs (the operator's transitions and kopf's warnings).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# A job's captured stacks (docs/health.md, Stacks): one ConfigMap per job, <job>-stacks, owned by
# it, created and merge-patched when its pods' agents capture stacks; read (get) first, by that
# name only, to check that one of that name is the job's own (another is left alone).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
{{- end }}

{{/* kopf peering (ha.enabled only): kopf watches the peering object and patches its keep-alive
into it; the operator reads it (get) to pause its resync loop while a higher priority peer lives. */}}
{{- define "ddpjob-operator.peeringVerbs" -}}
["get", "list", "watch", "patch"]
{{- end }}
