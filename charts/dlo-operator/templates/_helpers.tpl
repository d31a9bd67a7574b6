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

{{- /*
One operator per namespace: a second release whose watched namespaces overlap an existing
operator's (either one watching every namespace counts as overlapping) is refused at
install, naming the existing release. helm template (no cluster) checks nothing.
*/ -}}
{{- define "dlo-operator.refuseOverlap" -}}
{{- $mine := .Values.watchNamespaces -}}
{{- range $other := (lookup "apps/v1" "Deployment" "" "").items -}}
{{- $labels := $other.metadata.labels | default dict -}}
{{- $theirRelease := get $labels "app.kubernetes.io/instance" -}}
{{- $same := and (eq $theirRelease $.Release.Name) (eq $other.metadata.namespace $.Release.Namespace) -}}
{{- if and (eq (get $labels "app.kubernetes.io/name") "dlo-operator") (not $same) -}}
{{- $annotations := $other.metadata.annotations | default dict -}}
{{- $theirs := get $annotations "dlo.dev/watch-namespaces" | splitList "," | compact -}}
{{- $where := "every namespace" -}}
{{- if $theirs }}{{ $where = join ", " $theirs }}{{ end -}}
{{- $overlap := or (not $mine) (not $theirs) -}}
{{- range $mine }}{{ if has . $theirs }}{{ $overlap = true }}{{ end }}{{ end -}}
{{- if $overlap -}}
{{- fail (printf "watchNamespaces: release %s in namespace %s already runs a dlo-operator watching %s; two operators would reconcile the same DiffusionDeployments. Uninstall it, or give each release disjoint watchNamespaces" $theirRelease $other.metadata.namespace $where) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
