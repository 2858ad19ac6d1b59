#!/usr/bin/env bash
# Install the system programs the integration tests run for real (sshd, Chromium, PostgreSQL
# for the team profile's tests, which start a throwaway cluster of their own: tests/postgres.py),
# when missing and when this user may. Tests that need one skip with a clear reason otherwise.
set -u
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
# Debian puts initdb/pg_ctl under /usr/lib/postgresql/N/bin, not on PATH; tests look there too.
command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${need[*]} and cannot install them here (needs root and apt-get); those tests will skip" >&2
  exit 0
fi
echo "system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || echo "system-deps: could not install ${need[*]}; those tests will skip" >&2
exit 0
