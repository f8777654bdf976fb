#!/bin/sh
# nats-server for the compose stack, run from the epd image as its user epd (installed as epd-nats).
# Arguments are nats-server's (deploy/docker-compose.yml: -js -sd /var/lib/nats ...).
#
# Per-role users (deploy/compose.auth.yml) arrive as the secret /run/secrets/nats-auth.conf: a bind mount
# of the file `epd credentials` wrote, mode 0600 and owned by whoever ran it, which epd cannot read. The
# overlay therefore starts this container as root, for this one step: root copies the users to a file
# only epd may read (0400, on a private tmpfs), hands epd the JetStream store (a volume made by an older
# image may belong to root), and runs nats-server as epd with no capabilities left. A secret that is
# there but cannot be read stops the container: NATS never starts open when users were asked for.
set -eu

secret=/run/secrets/nats-auth.conf
private=/run/nats  # compose.auth.yml mounts a tmpfs here; the copy never reaches the disk

store_of() {  # the value of -sd / --store_dir among nats-server's arguments
    while [ $# -gt 1 ]; do
        case "$1" in -sd|--store_dir|-store_dir) echo "$2"; return ;; esac
        shift
    done
}

if [ "$(id -u)" = 0 ]; then
    if [ -f "$secret" ]; then
        install -d -o epd -g epd -m 0700 "$private"
        install -o epd -g epd -m 0400 "$secret" "$private/nats-auth.conf"
    fi
    store=$(store_of "$@")
    if [ -n "$store" ]; then
        install -d -o epd -g epd -m 0700 "$store"
        chown -R epd:epd "$store"
    fi
    exec setpriv --reuid=epd --regid=epd --init-groups --inh-caps=-all --no-new-privs -- "$0" "$@"
fi

if [ -f "$private/nats-auth.conf" ]; then
    set -- -c "$private/nats-auth.conf" "$@"
elif [ -f "$secret" ]; then
    if [ ! -r "$secret" ]; then
        echo "epd-nats: $secret (the NATS users) is not readable by uid $(id -u); start this container as" \
             "root (deploy/compose.auth.yml does: user: root), it copies the users for epd and drops root" >&2
        exit 1
    fi
    set -- -c "$secret" "$@"
fi
exec nats-server "$@"
