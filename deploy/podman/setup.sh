#!/usr/bin/env bash
# Makes this machine able to run Tandem's compose file under podman: podman, runc, mmdebstrap and
# their helpers from Debian's apt when missing (as root), and the two container settings a host
# whose cgroups the default crun runtime cannot drive needs (runc; no default ulimits).
set -euo pipefail

missing=()
for tool in podman runc mmdebstrap newuidmap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "podman setup: missing ${missing[*]}; install podman, runc, mmdebstrap and uidmap" >&2
    exit 1
  fi
  echo "podman setup: installing podman runc mmdebstrap uidmap (missing: ${missing[*]})"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc mmdebstrap uidmap >/dev/null
fi

conf=/etc/containers/containers.conf
if [[ $(id -u) -eq 0 ]] && ! grep -q '^# tandem: runc' "$conf" 2>/dev/null; then
  mkdir -p /etc/containers
  cat >>"$conf" <<'CONF'
# tandem: runc (crun cannot drive this host's cgroups) and no default ulimits
[containers]
default_ulimits = []

[engine]
runtime = "runc"
CONF
  echo "podman setup: $conf uses runc, no default ulimits"
fi
podman --version
