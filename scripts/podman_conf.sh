# Sourced by scripts/setup.sh (and tests/ops/test_podman_conf.py): podman's configuration
# for a machine like this one, written only where the machine has none of its own.
#
# podman (containers-common) reads its engine configuration from, in order: the system's
# /usr/share/containers/containers.conf and /etc/containers/containers.conf, the drop-in
# folders containers.conf.d (and containers.rootful.conf.d, containers.rootless.conf.d)
# beside each, the user's $XDG_CONFIG_HOME/containers/containers.conf (default
# ~/.config/containers) and its containers.conf.d; CONTAINERS_CONF names a file used
# instead of all of them, CONTAINERS_CONF_OVERRIDE one read last. Any of these is the
# machine's own set-up (docker's or podman's), and we leave it alone.
#
# Except a file a package ships unchanged: Debian's golang-github-containers-common ships
# /usr/share/containers/containers.conf, the defaults (all commented out), as the base
# every host has. It says nothing of this machine; it counts only once someone edited it
# (its checksum no longer the one the package recorded in /var/lib/dpkg/info/*.md5sums).

# The file we write: no default ulimits (raising RLIMIT_NPROC needs CAP_SYS_RESOURCE, which a
# sandbox may lack), cgroupfs rather than systemd (no systemd runs here), runc (crun refuses
# hybrid cgroups), and events in a file (no journald).
PODMAN_CONF_LINES=('# Written by hypermesh scripts/setup.sh (none was here).' '[containers]'
                   'default_ulimits = []' '[engine]' 'cgroup_manager = "cgroupfs"'
                   'runtime = "runc"' 'events_logger = "file"')

# podman_conf_shipped ROOT REL: whether ROOT/REL is a file exactly as a Debian package shipped
# it (REL without a leading slash, as dpkg's md5sums name it).
podman_conf_shipped() {
  local root=$1 rel=$2 sum
  sum=$(md5sum <"$root/$rel" | cut -d' ' -f1) || return 1
  grep -qsxF "$sum  $rel" "$root"/var/lib/dpkg/info/*.md5sums
}

# podman_conf_found ROOT: print the first configuration podman would read under the system
# root ROOT ("" for this machine; the user's files come from HOME and XDG_CONFIG_HOME as
# set) and succeed; fail, printing nothing, when there is none.
podman_conf_found() {
  local root=$1 user path dir
  if [ -n "${CONTAINERS_CONF:-}" ]; then echo "CONTAINERS_CONF=$CONTAINERS_CONF"; return 0; fi
  if [ -n "${CONTAINERS_CONF_OVERRIDE:-}" ]; then
    echo "CONTAINERS_CONF_OVERRIDE=$CONTAINERS_CONF_OVERRIDE"; return 0
  fi
  for dir in "$root/usr/share/containers" "$root/etc/containers"; do
    for path in "$dir/containers.conf" "$dir"/containers.conf.d/*.conf \
        "$dir"/containers.rootful.conf.d/*.conf "$dir"/containers.rootless.conf.d/*.conf; do
      # An unmatched glob stays as written, and names no file.
      if [ -e "$path" ] && ! podman_conf_shipped "$root" "${path#"$root"/}"; then
        echo "$path"; return 0
      fi
    done
  done
  user=${XDG_CONFIG_HOME:-${HOME:-/nonexistent}/.config}/containers
  for path in "$user/containers.conf" "$user"/containers.conf.d/*.conf; do
    if [ -e "$path" ]; then echo "$path"; return 0; fi
  done
  return 1
}

# podman_conf_ensure ROOT: write ROOT/etc/containers/containers.conf unless podman_conf_found
# finds a configuration (with $SUDO, if set, for the write). Idempotent: the file written
# is found the next time.
podman_conf_ensure() {
  local root=$1
  if podman_conf_found "$root" >/dev/null; then return 0; fi
  echo "setup: writing $root/etc/containers/containers.conf for podman" >&2
  ${SUDO:-} mkdir -p "$root/etc/containers"
  printf '%s\n' "${PODMAN_CONF_LINES[@]}" | ${SUDO:-} tee "$root/etc/containers/containers.conf" \
    >/dev/null
}
