#!/usr/bin/env bash
# Build the agent-runtime server image from deploy/Dockerfile, with the repository root as the
# build context (.dockerignore there keeps it to pyproject.toml, requirements.lock, README.md
# and src/).
#
#   deploy/build_image.sh TAG [extra docker build arguments…]
#   deploy/build_image.sh registry.example.com/agent-runtime:0.1.0 --push   # with buildx
#
# Needs a docker CLI and a reachable daemon; says so and exits 2 when either is missing.
set -euo pipefail

usage() {
  echo "usage: $0 TAG [docker build args…]   e.g. $0 agent-runtime:0.1.0" >&2
  exit 2
}

[ $# -ge 1 ] || usage
case $1 in -h | --help | -*) usage ;; esac
tag=$1
shift

if ! command -v docker >/dev/null 2>&1; then
  echo "build_image: docker is not installed (no 'docker' on PATH); install Docker or build" \
    "deploy/Dockerfile with another OCI builder from the repository root" >&2
  exit 2
fi
if ! docker info >/dev/null 2>&1; then
  echo "build_image: docker is installed but no daemon answers ('docker info' failed);" \
    "start Docker or point DOCKER_HOST at one" >&2
  exit 2
fi

root=$(cd "$(dirname "$0")/.." && pwd)
revision=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)

set -x
exec docker build \
  --file "$root/deploy/Dockerfile" \
  --tag "$tag" \
  --label "org.opencontainers.image.title=agent-runtime" \
  --label "org.opencontainers.image.version=${version:-unknown}" \
  --label "org.opencontainers.image.revision=$revision" \
  "$@" \
  "$root"
