#!/usr/bin/env bash
# Generates the certificates of the tenancy tests into DIR with the openssl CLI (nothing is
# checked in): two CAs, a server certificate for 127.0.0.1/localhost, and client certificates
# of CA one: with a URI SAN (kvpool://tenant/team-a), CN only (team-b-cert), expired (URI SAN
# team-a); and of CA two (URI SAN team-a). A second server certificate (server2) serves the
# rotation test.
#
#   tests/integration/make_test_certs.sh DIR
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"
quiet() { "$@" >/dev/null 2>&1 || { echo "failed: $*" >&2; "$@"; exit 1; }; }

ca() {  # name
  quiet openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.pem" -days 30 \
    -subj "/CN=kvpool test $1" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign"
}

# leaf NAME CA SUBJECT EXTFILE-LINES [START END]: a certificate of CA, via `openssl ca` so that
# the validity period can lie in the past.
leaf() {
  local name=$1 issuer=$2 subject=$3 ext=$4 start=${5:-} end=${6:-}
  quiet openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subject"
  mkdir -p "db-$issuer"
  touch "db-$issuer/index.txt"
  [ -f "db-$issuer/serial" ] || echo 1000 > "db-$issuer/serial"
  cat > "$name.cnf" <<CNF
[ca]
default_ca = test_ca
[test_ca]
database = db-$issuer/index.txt
serial = db-$issuer/serial
new_certs_dir = db-$issuer
certificate = $issuer.pem
private_key = $issuer.key
default_md = sha256
policy = any
unique_subject = no
copy_extensions = none
[any]
commonName = supplied
[ext]
basicConstraints = CA:FALSE
$ext
CNF
  local dates=(-days 30)
  if [ -n "$start" ]; then dates=(-startdate "$start" -enddate "$end"); fi
  quiet openssl ca -batch -config "$name.cnf" -extensions ext -in "$name.csr" -out "$name.pem" \
    -notext "${dates[@]}"
}

ca ca
ca other-ca
leaf server ca "/CN=kvpoold" "subjectAltName = DNS:localhost,IP:127.0.0.1
extendedKeyUsage = serverAuth"
leaf server2 ca "/CN=kvpoold rotated" "subjectAltName = DNS:localhost,IP:127.0.0.1
extendedKeyUsage = serverAuth"
leaf client-uri ca "/CN=not-a-tenant" "subjectAltName = URI:kvpool://tenant/team-a
extendedKeyUsage = clientAuth"
leaf client-cn ca "/CN=team-b-cert" "extendedKeyUsage = clientAuth"
leaf client-expired ca "/CN=expired" "subjectAltName = URI:kvpool://tenant/team-a
extendedKeyUsage = clientAuth" 20200101000000Z 20200102000000Z
leaf client-other-ca other-ca "/CN=team-b-cert" "subjectAltName = URI:kvpool://tenant/team-a
extendedKeyUsage = clientAuth"
