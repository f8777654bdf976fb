#!/usr/bin/env bash
# A Docker engine for a machine that has no container networking to offer and must keep every packet on
# loopback (tests/test_docker.py runs against it): no bridge, no iptables rules, its own data and exec
# roots and socket, so it touches no other engine on the host. Needs root and docker.io
# (apt-get install docker.io), plus Docker Compose v2 for the compose stack.
#
#   deploy/dockerd-loopback.sh [DIR]        # default DIR: /tmp/epd-docker; prints the DOCKER_HOST to use
#   export DOCKER_HOST=unix:///tmp/epd-docker/docker.sock
#   kill "$(cat /tmp/epd-docker/dockerd.pid)"     # stop it
#
# The default bridge is off, and so is NAT: containers reach nothing outside. Host networking
# (deploy/compose.host.yml) works everywhere; where the kernel lets dockerd make bridges, Compose's own
# networks work too (containers reach each other and the host). overlay2 is used where the kernel offers
# it, else vfs (every layer a full copy: slower builds, more disk).
set -euo pipefail
dir=${1:-/tmp/epd-docker}
mkdir -p "$dir"
socket="unix://$dir/docker.sock"
if DOCKER_HOST=$socket docker version >/dev/null 2>&1; then echo "$socket"; exit 0; fi
driver=vfs
grep -qw overlay /proc/filesystems 2>/dev/null && driver=overlay2
nohup dockerd --host "$socket" --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
    --storage-driver "$driver" --bridge none --iptables=false --ip6tables=false >"$dir/dockerd.log" 2>&1 &
for _ in $(seq 1 60); do
    DOCKER_HOST=$socket docker version >/dev/null 2>&1 && { echo "$socket"; exit 0; }
    sleep 0.5
done
echo "dockerd did not start; see $dir/dockerd.log" >&2
exit 1
