#!/usr/bin/env bash
# A throwaway PKI for deploy/compose/tls.yaml: a CA and one certificate (EC P-256, for serverAuth
# and clientAuth) that every service presents, naming the services' shared name and the names
# clients use for the published ports. Not for production: use your own CA there.
#
#   deploy/compose/make-certs.sh [DIR] [NAME...]
#
# DIR: where ca.pem, server.pem and server.key go (default deploy/compose/certs, git-ignored).
# NAME: DNS names or IP addresses in the certificate (default: tandem localhost 127.0.0.1).
set -euo pipefail
dir=${1:-"$(dirname "$0")/certs"}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(tandem localhost 127.0.0.1)
san=""
for name in "${names[@]}"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
  -keyout ca.key -out ca.pem -subj "/CN=tandem-ca" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout server.key -out server.csr -subj "/CN=${names[0]}" 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "${san%,}" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
  -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 0644 server.key  # read by the containers' user through the compose secret
echo "wrote $(pwd)/{ca.pem,server.pem,server.key} for: ${names[*]}"
