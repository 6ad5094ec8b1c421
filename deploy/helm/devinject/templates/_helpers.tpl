{{/* The labels every object carries: kustomize's part-of (deploy/kubernetes) and Helm's own. */}}
{{- define "devinject.labels" -}}
app.kubernetes.io/part-of: devinject
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "devinject.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* A path on the host under hostRoot: "/" + "/proc" is "/proc", "/x" + "/proc" is "/x/proc". */}}
{{- define "devinject.hostPath" -}}
{{ trimSuffix "/" .root.Values.hostRoot }}{{ .path }}
{{- end -}}
