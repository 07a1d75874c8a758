# Sourced by the set-up scripts: `apt_install PKG...` installs the given Debian/Ubuntu packages
# (sudo when not root); nothing when the list is empty.
apt_install() {
  [ $# -gt 0 ] || return 0
  printf '[apt] installing: %s\n' "$*" >&2
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
