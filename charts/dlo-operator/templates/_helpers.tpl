{{- define "dlo-operator.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dlo-operator.labels" -}}
app.kubernetes.io/name: dlo-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dlo-operator.selectorLabels" -}}
app.kubernetes.io/name: dlo-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
