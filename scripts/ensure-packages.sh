#!/bin/sh
# Install the Debian packages named as arguments when any is missing.
# Usage: scripts/ensure-packages.sh PACKAGE...
set -eu
missing=""
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing="$missing $package"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "gpucloud needs these Debian packages:$missing — run as root, or: sudo apt-get install$missing" >&2
    exit 1
fi
echo "installing Debian packages:$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
