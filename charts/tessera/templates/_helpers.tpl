{{/* Labels of every object but the CRD: name, part-of, version, commonLabels. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: tessera
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* <registry>/<repository>:<tag> of a daemon, its own settings first. */}}
{{- define "tessera.image" -}}
{{- $global := .root.Values.image -}}
{{- $registry := .image.registry | default $global.registry -}}
{{- $tag := .image.tag | default $global.tag | default .root.Chart.AppVersion -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) .image.repository $tag -}}
{{- end }}

{{- define "tessera.pullPolicy" -}}
{{- .image.pullPolicy | default .root.Values.image.pullPolicy -}}
{{- end }}

{{/*
The GPU resource names, besides koordinator.sh/gpu*, that tessera-scheduler manages:
a CEL list, for the admission policies.
*/}}
{{- define "tessera.gpuResourceNames" -}}
['nvidia.com/gpu', 'nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores', 'aliyun.com/gpu-mem', 'volcano.sh/gpu-memory', 'volcano.sh/gpu-number', 'volcano.sh/vgpu-number', 'volcano.sh/vgpu-memory', 'volcano.sh/vgpu-memory-percentage', 'volcano.sh/vgpu-cores']
{{- end }}
