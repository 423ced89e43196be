#!/usr/bin/env bash
# Builds Compose's CPU image (tandem-cpu:latest) with podman where no image registry can be
# reached: the base is made from Debian packages with mmdebstrap (Python 3.11 and pip), and the
# build reaches the package index through this host's pip configuration (its config files, CA
# bundle, local wheel directories and PIP_*/SSL_CERT_* variables are passed in).
#   deploy/podman/build.sh            # base once, then the image
#   TANDEM_BASE_IMAGE=python:3.11-slim deploy/podman/build.sh   # a registry's base instead
set -euo pipefail
cd "$(dirname "$0")/../.."

base=${TANDEM_BASE_IMAGE:-localhost/tandem-base:bookworm}
if [[ $base == localhost/tandem-base:* ]] && ! podman image exists "$base"; then
  tar=$(mktemp --suffix=.tar)
  trap 'rm -f "$tar"' EXIT
  echo "build: making $base from Debian packages (mmdebstrap)"
  mmdebstrap --quiet --variant=apt --include=python3,python3-pip,python3-venv,ca-certificates,passwd \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    --customize-hook='ln -sf python3 "$1"/usr/bin/python; ln -sf pip3 "$1"/usr/bin/pip' \
    bookworm "$tar"
  podman import --quiet "$tar" "$base" >/dev/null
fi

# The host's pip setup, as the build sees it.
args=()
for var in $(compgen -e); do
  case $var in PIP_*|SSL_CERT_*|REQUESTS_CA_BUNDLE) args+=(--env "$var=${!var}") ;; esac
done
mounts=()
for path in /etc/pip.conf /etc/xdg/pip "$HOME/.config/pip" "$HOME/.pip" /etc/ssl/certs \
            ${PIP_CONFIG_FILE:-} ${PIP_CERT:-} ${SSL_CERT_FILE:-}; do
  [[ -e $path ]] && mounts+=(-v "$(readlink -f "$path"):$path:ro")
done
for dir in ${PIP_FIND_LINKS:-}; do  # local wheel directories (URLs need no mount)
  [[ -d $dir ]] && mounts+=(-v "$dir:$dir:ro")
done
# Where a local wheel directory holds torch, pip's own configuration picks it (no CPU index).
torch_index=${TORCH_INDEX_URL-}
if [[ -z ${TORCH_INDEX_URL+set} ]] && ! ls ${PIP_FIND_LINKS:-/nonexistent}/torch-* >/dev/null 2>&1; then
  torch_index=https://download.pytorch.org/whl/cpu
fi

echo "build: tandem-cpu:latest from $base"
podman build --quiet --network host -f deploy/docker/Dockerfile.cpu -t tandem-cpu:latest \
  --build-arg "BASE_IMAGE=$base" --build-arg "TORCH_INDEX_URL=$torch_index" \
  "${args[@]}" "${mounts[@]}" .
