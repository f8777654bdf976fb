#!/usr/bin/env bash
# A base image for deploy/Dockerfile made on this machine, for hosts that reach no image registry:
# Debian bookworm (minbase) with its Python 3.11, built by debootstrap and loaded with `docker import`.
#
#   sudo deploy/base-image.sh [TAG]                     # default tag: epd-base:bookworm (about 1 minute)
#   docker build -f deploy/Dockerfile --build-arg BASE=epd-base:bookworm -t epd .
#
# Needs root, debootstrap (apt-get install debootstrap) and a Docker engine (DOCKER_HOST is honoured).
# Debian's own mirror is debootstrap's default; DEBIAN_MIRROR overrides it.
set -euo pipefail
tag=${1:-epd-base:bookworm}
root=$(mktemp -d "${TMPDIR:-/tmp}/epd-base.XXXXXX")
trap 'rm -rf "$root"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$root" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} >&2
# Trust what this host trusts: certificates its administrator added (a proxy's, a company's CA) go into
# the image's bundle, and pip and uv are pointed at that bundle (uv otherwise uses roots of its own).
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >&2
fi
# What an image never needs: package lists and caches, documentation, translations.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/locale/* "$root"/var/log/*
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "$tag"
