#!/usr/bin/env bash
# Render the agent-runtime Kubernetes manifests for one installation, and apply them.
#
#   deploy/render_and_apply.sh ENV_FILE [--out DIR] [--apply]
#
# ENV_FILE (start from deploy/k8s.env.example) chooses the overlay (dev | prod) and supplies
# the image, the two namespaces, the replica count, an optional NodePort, the AGENT_RUNTIME_*
# settings (→ ConfigMap) and the secrets (Redis / DB URLs, tokens → Secret). The overlay is
# rendered with `kubectl kustomize` through a generated kustomization in a private temporary
# directory (removed on exit); nothing is written into the repository.
#
#   without --apply  render only (dry): to stdout, or to DIR/agent-runtime.yaml with --out
#   --apply          render, then `kubectl apply --server-side` the rendered file and wait for
#                    the rollout. Refused while anything is missing.
#
# Refusal: a required value that is missing, or any placeholder left in the env file or in the
# rendered manifests (__REPLACE_ME__, CHANGE_ME, an unexpanded ${…}), is listed on stderr and
# the exit status is 3; with --apply nothing is applied. The manifests are still rendered, so
# an incomplete file can be inspected.
#
# Exit status: 0 done; 2 usage, malformed env file, kubectl missing; 3 missing values or
# placeholders (not applied); else kubectl's own status.
#
# ENV_FILE format: KEY=VALUE per line, `#` comment lines, optional `export `, optional quotes
# around the whole value; no inline comments, no variable expansion (the file is read, never
# sourced).
set -euo pipefail
if [ "${BASH_VERSINFO[0]}" -lt 4 ]; then
  echo "render_and_apply: needs bash >= 4 (this is $BASH_VERSION)" >&2
  exit 2
fi

here=$(cd "$(dirname "$0")" && pwd -P)
k8s_dir=$here/k8s
PLACEHOLDER_RE='__REPLACE_ME__|CHANGE_ME|\$\{[^}]*\}'
# base64 of a whole value "__REPLACE_ME__" (how a Secret placeholder looks once rendered)
PLACEHOLDER_B64=X19SRVBMQUNFX01FX18
# What the base calls its two namespaces; moved by label to NAMESPACE / AGENTSERVER_NAMESPACE.
BASE_NAMESPACE=agent-runtime
DEPLOY_KEYS=" OVERLAY IMAGE NAMESPACE AGENTSERVER_NAMESPACE REPLICAS NODEPORT KUBE_CONTEXT "
SECRET_KEYS=" AGENT_RUNTIME_REDIS_URL AGENT_RUNTIME_DATABASE_URL"
SECRET_KEYS+=" AGENT_RUNTIME_ADMIN_TOKENS AGENT_RUNTIME_GATEWAY_TOKENS "
# fixed by the manifests (container port, probes, in-cluster mode) or set from a deploy key
FIXED_KEYS=" AGENT_RUNTIME_MODE AGENT_RUNTIME_HOST AGENT_RUNTIME_PORT"
FIXED_KEYS+=" AGENT_RUNTIME_DEFAULT_NAMESPACE "

say() { printf 'render_and_apply: %s\n' "$*" >&2; }
die() { say "$*"; exit 2; }
usage() {
  echo "usage: $0 ENV_FILE [--out DIR] [--apply]" >&2
  exit 2
}

# --- arguments ---------------------------------------------------------------------------------
env_file="" out_dir="" apply=0
while [ $# -gt 0 ]; do
  case $1 in
    --apply) apply=1 ;;
    --out)
      [ $# -ge 2 ] || usage
      out_dir=$2
      shift
      ;;
    --out=*) out_dir=${1#--out=} ;;
    -h | --help) usage ;;
    -*) say "unknown option $1"; usage ;;
    *)
      [ -z "$env_file" ] || usage
      env_file=$1
      ;;
  esac
  shift
done
[ -n "$env_file" ] || usage
[ -f "$env_file" ] || die "env file $env_file does not exist"
command -v kubectl >/dev/null 2>&1 \
  || die "kubectl is not on PATH (kubectl >= 1.21 renders kustomize v4+; >= 1.27 has v5)"

# --- read the env file -------------------------------------------------------------------------
declare -A deploy=()
settings_keys=() settings_vals=() secret_keys=() secret_vals=()
declare -A seen=()
lineno=0
while IFS= read -r line || [ -n "$line" ]; do
  lineno=$((lineno + 1))
  line=${line%$'\r'}
  line=${line#"${line%%[![:space:]]*}"} # leading blanks
  line=${line%"${line##*[![:space:]]}"} # trailing blanks
  case $line in '' | '#'*) continue ;; esac
  if [[ ! $line =~ ^(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
    die "$env_file:$lineno: not KEY=VALUE"
  fi
  key=${BASH_REMATCH[2]} value=${BASH_REMATCH[3]}
  if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
  [ -z "${seen[$key]:-}" ] || die "$env_file:$lineno: $key is set twice"
  seen[$key]=1
  if [[ $DEPLOY_KEYS == *" $key "* ]]; then
    deploy[$key]=$value
  elif [[ $SECRET_KEYS == *" $key "* ]]; then
    secret_keys+=("$key") secret_vals+=("$value")
  elif [[ $FIXED_KEYS == *" $key "* ]]; then
    die "$env_file:$lineno: $key is fixed by the manifests (namespace: set AGENTSERVER_NAMESPACE)"
  elif [[ $key == AGENT_RUNTIME_* ]]; then
    settings_keys+=("$key") settings_vals+=("$value")
  else
    die "$env_file:$lineno: unknown key $key (deploy keys:$DEPLOY_KEYS; settings: AGENT_RUNTIME_*)"
  fi
done <"$env_file"

# --- check what it says; collect what is missing -----------------------------------------------
missing=()
is_placeholder() { [[ $1 =~ $PLACEHOLDER_RE ]]; }
need() { # key value → value is set and not a placeholder
  if [ -z "$2" ]; then
    missing+=("$1: not set")
  elif is_placeholder "$2"; then
    missing+=("$1: placeholder left")
  fi
}

for key in REPLICAS NODEPORT KUBE_CONTEXT; do # optional: a placeholder counts as missing
  if is_placeholder "${deploy[$key]:-}"; then
    missing+=("$key: placeholder left (leave it empty for the default)")
    deploy[$key]=""
  fi
done

overlay=${deploy[OVERLAY]:-} overlays=""
for d in "$k8s_dir"/overlays/*/; do overlays+=" $(basename "$d")"; done
[ -n "$overlay" ] || die "OVERLAY is not set (one of:$overlays)"
[[ $overlay =~ ^[a-z0-9-]+$ && -d $k8s_dir/overlays/$overlay ]] \
  || die "OVERLAY=$overlay: no such overlay (one of:$overlays)"

namespace=${deploy[NAMESPACE]:-$BASE_NAMESPACE}
agentserver_namespace=${deploy[AGENTSERVER_NAMESPACE]:-agentservers}
for pair in "NAMESPACE=$namespace" "AGENTSERVER_NAMESPACE=$agentserver_namespace"; do
  if [[ ! ${pair#*=} =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]]; then
    is_placeholder "${pair#*=}" && { missing+=("${pair%%=*}: placeholder left"); continue; }
    die "${pair%%=*}=${pair#*=}: not a namespace name (DNS-1123 label)"
  fi
done

image=${deploy[IMAGE]:-} image_name="" image_tag="" image_digest=""
need IMAGE "$image"
if [ -n "$image" ] && ! is_placeholder "$image"; then
  if [[ $image == *@* ]]; then
    image_name=${image%%@*} image_digest=${image#*@}
    [[ $image_digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "IMAGE=$image: bad digest"
  elif [[ ${image##*/} == *:* ]]; then
    image_name=${image%:*} image_tag=${image##*:}
    [[ $image_tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "IMAGE=$image: bad tag"
  else
    die "IMAGE=$image: give a tag or a digest (name:tag or name@sha256:…), never an implicit latest"
  fi
  [[ $image_name =~ ^[a-z0-9]([a-z0-9._/:-]*[a-z0-9])?$ ]] || die "IMAGE=$image: bad name"
fi

replicas=${deploy[REPLICAS]:-}
if [ -n "$replicas" ]; then
  [[ $replicas =~ ^[0-9]+$ ]] || die "REPLICAS=$replicas: not a number"
  [ "$replicas" -ge 2 ] \
    || die "REPLICAS=$replicas: at least 2 (drain, PDB and anti-affinity assume it)"
fi

nodeport=${deploy[NODEPORT]:-}
if [ -n "$nodeport" ] && [ "$nodeport" != auto ]; then
  if [[ ! $nodeport =~ ^[0-9]+$ ]] || [ "$nodeport" -lt 30000 ] || [ "$nodeport" -gt 32767 ]; then
    die "NODEPORT=$nodeport: empty (none), auto, or 30000-32767"
  fi
fi

allow_unauthenticated=false
allow_open_gateway=false
for i in "${!settings_keys[@]}"; do
  is_placeholder "${settings_vals[$i]}" && missing+=("${settings_keys[$i]}: placeholder left")
  if [ "${settings_keys[$i]}" = AGENT_RUNTIME_ALLOW_UNAUTHENTICATED ]; then
    allow_unauthenticated=$(printf '%s' "${settings_vals[$i]}" | tr '[:upper:]' '[:lower:]')
  fi
  if [ "${settings_keys[$i]}" = AGENT_RUNTIME_ALLOW_OPEN_GATEWAY ]; then
    allow_open_gateway=$(printf '%s' "${settings_vals[$i]}" | tr '[:upper:]' '[:lower:]')
  fi
done
open_gateway_allowed=false
if [[ $allow_unauthenticated =~ ^(1|true|yes|on)$ ]] || [[ $allow_open_gateway =~ ^(1|true|yes|on)$ ]]; then
  open_gateway_allowed=true
fi

secret_value() { # key → value ('' and status 1 when absent)
  local i
  for i in "${!secret_keys[@]}"; do
    if [ "${secret_keys[$i]}" = "$1" ]; then printf '%s' "${secret_vals[$i]}"; return 0; fi
  done
  return 1
}
for key in $SECRET_KEYS; do
  if ! value=$(secret_value "$key"); then
    if [ "$key" = AGENT_RUNTIME_GATEWAY_TOKENS ]; then
      missing+=("$key: not set (empty is allowed with AGENT_RUNTIME_ALLOW_OPEN_GATEWAY=true)")
    else
      missing+=("$key: not set")
    fi
    secret_keys+=("$key") secret_vals+=("__REPLACE_ME__") # rendered as a visible placeholder
  elif [ "$key" = AGENT_RUNTIME_GATEWAY_TOKENS ] && [ "$open_gateway_allowed" = true ]; then
    is_placeholder "$value" && missing+=("$key: placeholder left")
  elif [ "$key" = AGENT_RUNTIME_ADMIN_TOKENS ] \
    && [[ $allow_unauthenticated =~ ^(1|true|yes|on)$ ]]; then
    is_placeholder "$value" && missing+=("$key: placeholder left")
  else
    need "$key" "$value"
  fi
done

# --- render ------------------------------------------------------------------------------------
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
work=$(cd "$work" && pwd -P)
up="" d=$work
while [ "$d" != / ]; do up="../$up" d=$(dirname "$d"); done
rel() { printf '%s%s' "$up" "${1#/}"; } # kustomize wants paths relative to the kustomization

: >"$work/settings.env"
for i in "${!settings_keys[@]}"; do # an empty setting is left out: its default applies
  [ -z "${settings_vals[$i]}" ] \
    || printf '%s=%s\n' "${settings_keys[$i]}" "${settings_vals[$i]}" >>"$work/settings.env"
done
printf 'AGENT_RUNTIME_DEFAULT_NAMESPACE=%s\n' "$agentserver_namespace" >>"$work/settings.env"
: >"$work/secrets.env"
for i in "${!secret_keys[@]}"; do
  printf '%s=%s\n' "${secret_keys[$i]}" "${secret_vals[$i]}" >>"$work/secrets.env"
done

{
  cat <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(rel "$k8s_dir/overlays/$overlay")
EOF
  if [ -n "$nodeport" ]; then
    printf 'components:\n  - %s\n' "$(rel "$k8s_dir/components/nodeport")"
  fi
  if [ -n "$image_name" ]; then
    printf 'images:\n  - name: agent-runtime\n    newName: "%s"\n' "$image_name"
    if [ -n "$image_digest" ]; then
      printf '    digest: "%s"\n' "$image_digest"
    else
      printf '    newTag: "%s"\n' "$image_tag"
    fi
  fi
  if [ -n "$replicas" ]; then
    printf 'replicas:\n  - name: agent-runtime\n    count: %s\n' "$replicas"
  fi
  cat <<EOF
configMapGenerator:
  - name: agent-runtime-config
    namespace: $BASE_NAMESPACE
    behavior: merge
    envs: [settings.env]
secretGenerator:
  - name: agent-runtime-secrets
    namespace: $BASE_NAMESPACE
    behavior: replace
    type: Opaque
    envs: [secrets.env]
    options:
      labels:
        app.kubernetes.io/component: control-plane
patches:
  - target:
      labelSelector: app.kubernetes.io/component=control-plane
    patch: '[{"op": "replace", "path": "/metadata/namespace", "value": "$namespace"}]'
  - target:
      labelSelector: app.kubernetes.io/component=agentserver-rbac
    patch: '[{"op": "replace", "path": "/metadata/namespace", "value": "$agentserver_namespace"}]'
  - target:
      kind: RoleBinding
      labelSelector: app.kubernetes.io/component=agentserver-rbac
    patch: '[{"op": "replace", "path": "/subjects/0/namespace", "value": "$namespace"}]'
  - target:
      kind: ClusterRoleBinding
      labelSelector: app.kubernetes.io/component=node-reader-rbac
    patch: '[{"op": "replace", "path": "/subjects/0/namespace", "value": "$namespace"}, {"op": "replace", "path": "/metadata/name", "value": "agent-runtime-node-reader-$namespace"}]'
EOF
  if [[ $nodeport =~ ^[0-9]+$ ]]; then
    cat <<EOF
  - target:
      kind: Service
      name: agent-runtime-nodeport
    patch: '[{"op": "add", "path": "/spec/ports/0/nodePort", "value": $nodeport}]'
EOF
  fi
} >"$work/kustomization.yaml"

rendered=$work/agent-runtime.yaml
if ! kubectl kustomize "$work" >"$rendered"; then
  say "kubectl kustomize failed (needs kubectl >= 1.21; see the error above)"
  exit 1
fi

while IFS= read -r hit; do
  line=${hit#*:}
  [[ $line != *"$PLACEHOLDER_B64"* ]] || line="${line%%:*}: (a Secret value)" # never echo secrets
  missing+=("rendered line ${hit%%:*}: ${line#"${line%%[![:space:]]*}"}")
done < <(grep -n -E -e "$PLACEHOLDER_RE" -e "$PLACEHOLDER_B64" "$rendered" || true)

# --- output ------------------------------------------------------------------------------------
if [ -n "$out_dir" ]; then
  mkdir -p "$out_dir"
  rm -f "$out_dir/agent-runtime.yaml" # a fresh file: mode 600 (umask), it holds the Secret
  cp "$rendered" "$out_dir/agent-runtime.yaml"
  rendered=$(cd "$out_dir" && pwd -P)/agent-runtime.yaml
  say "rendered overlay $overlay to $rendered"
elif [ "$apply" = 0 ]; then
  cat "$rendered"
fi

if [ ${#missing[@]} -gt 0 ]; then
  say "NOT applicable: ${#missing[@]} missing value(s) or placeholder(s) in $env_file:"
  printf '  - %s\n' "${missing[@]}" >&2
  [ "$apply" = 0 ] || say "nothing applied"
  exit 3
fi
[ "$apply" = 1 ] || exit 0

# --- apply -------------------------------------------------------------------------------------
# Server-side apply: no last-applied annotation (it would hold a copy of the Secret), and
# conflicting field owners are reported instead of silently overwritten.
context=()
[ -z "${deploy[KUBE_CONTEXT]:-}" ] || context=(--context "${deploy[KUBE_CONTEXT]}")
say "applying overlay $overlay: namespace $namespace, AgentServers in $agentserver_namespace"
kubectl ${context[@]+"${context[@]}"} apply --server-side --field-manager=agent-runtime-deploy \
  -f "$rendered"
kubectl ${context[@]+"${context[@]}"} --namespace "$namespace" \
  rollout status deployment/agent-runtime --timeout=10m
