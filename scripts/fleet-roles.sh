#!/usr/bin/env bash
# etcd users and roles for brokkr fleet mode (README "Fleet mode", docs/ARCHITECTURE.md "External contract").
#
#   scripts/fleet-roles.sh node NAME [PASSWORD]  user and role brokkr-node-NAME: may read only
#                                                <prefix>/nodes/NAME/desired and write only
#                                                <prefix>/nodes/NAME/status and .../alive
#   scripts/fleet-roles.sh admin [PASSWORD]      user and role brokkr-admin: read and write
#                                                everything under <prefix>/ (brokkr fleet ...)
#   scripts/fleet-roles.sh enable ROOTPASSWORD   create root and turn etcd auth on
#
# etcdctl (v3 API) takes its connection from the environment: ETCDCTL_ENDPOINTS,
# ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY, ETCDCTL_USER (root:PASSWORD once auth is on).
# PREFIX is the fleet key prefix (default /brokkr). Without PASSWORD a random one is made
# and printed; with client-certificate auth (etcd --client-cert-auth) the certificate's CN
# is the user name (brokkr-node-NAME) and the password is never used.
# Running it again is harmless: existing users and roles are kept, permissions re-granted.
set -euo pipefail
export ETCDCTL_API=3
PREFIX=${PREFIX:-/brokkr}
PREFIX=${PREFIX%/}

die() { echo "fleet-roles: $*" >&2; exit 1; }
command -v etcdctl >/dev/null || die "etcdctl not found (Debian: apt-get install etcd-client)"

ensure_user() { # NAME PASSWORD
  if etcdctl user get "$1" >/dev/null 2>&1; then return; fi
  local pw=$2 shown=""
  if [ -z "$pw" ]; then pw=$(head -c 18 /dev/urandom | base64 | tr -d '/+='); shown=$pw; fi
  etcdctl user add "$1:$pw" --interactive=false >/dev/null
  [ -n "$shown" ] && echo "user $1 password: $shown"
  return 0
}
ensure_role() { etcdctl role get "$1" >/dev/null 2>&1 || etcdctl role add "$1" >/dev/null; }

case "${1:-}" in
  node)
    name=${2:-}; [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$ ]] || die "node NAME: 1-63 of A-Z a-z 0-9 . _ -"
    u=brokkr-node-$name dir=$PREFIX/nodes/$name
    ensure_role "$u"
    # Exact keys, not prefixes: nodes/h1 must not match nodes/h10.
    etcdctl role grant-permission "$u" read "$dir/desired" >/dev/null
    etcdctl role grant-permission "$u" write "$dir/status" >/dev/null
    etcdctl role grant-permission "$u" write "$dir/alive" >/dev/null
    ensure_user "$u" "${3:-}"
    etcdctl user grant-role "$u" "$u" >/dev/null
    echo "node $name: user and role $u (read $dir/desired; write $dir/status, $dir/alive)"
    ;;
  admin)
    ensure_role brokkr-admin
    etcdctl role grant-permission brokkr-admin readwrite --prefix=true "$PREFIX/" >/dev/null
    ensure_user brokkr-admin "${2:-}"
    etcdctl user grant-role brokkr-admin brokkr-admin >/dev/null
    echo "admin: user and role brokkr-admin (readwrite $PREFIX/)"
    ;;
  enable)
    [ -n "${2:-}" ] || die "enable ROOTPASSWORD"
    ensure_user root "$2"
    ensure_role root
    etcdctl user grant-role root root >/dev/null 2>&1 || true # already granted on a re-run
    etcdctl auth enable >/dev/null
    echo "auth enabled (root user)"
    ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 1 ;;
esac
