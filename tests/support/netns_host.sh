#!/bin/bash
# Run a command "on" a test host of tests/support/netns_cluster.py. Called inside the host's network
# namespace (nsenter --net) and fresh private mount and UTS namespaces (unshare --mount --uts):
#
#   netns_host.sh HOSTNAME HOSTS_FILE COMMAND [ARGS...]
#
# Gives the host its own hostname and /etc/hosts (a bind mount, private to this mount namespace:
# the machine's /etc/hosts is never edited), then becomes COMMAND. Everything COMMAND starts
# (slurmd's job steps, sshd's sessions) inherits both.
set -e
host=$1
hosts=$2
shift 2
mount --bind "$hosts" /etc/hosts
hostname "$host"
exec "$@"
