#!/usr/bin/env bash
# Installs the Debian packages listed in scripts/system-packages.txt that are not yet present.
# Needs root (CI and these machines run as root); elsewhere it says what is missing and goes on,
# and the tests that need a missing tool skip with that reason.
set -euo pipefail
cd "$(dirname "$0")"
mapfile -t wanted < <(grep -vE '^\s*(#|$)' system-packages.txt | awk '{print $1}')
missing=()
for pkg in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: not root or no apt-get; missing Debian packages: ${missing[*]}" >&2
  exit 0
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
