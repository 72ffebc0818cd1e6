# The opaque-directory probe of the guest agent's "pack" (native/agent.c runs it with busybox sh
# as `pack.sh UPPER WORKDIR TOKEN`, the commands' cgroups frozen, and then tars UPPER itself).
#
# The opaque-directory mark is an xattr, and busybox reads none: an overlay of the writable layer
# over a tree with a probe file TOKEN in each of its directories shows the probe under a
# directory unless that directory, or one above it, is opaque. The paths where it shows go,
# NUL-separated, to WORKDIR/visible; exit status 0 when they could be found.
export PATH=/dev/.dsec/bin
up=$1 w=$2 token=$3
mkdir -p "$w/probe" "$w/view"
(cd "$up" && find . -type d -exec mkdir -p "$w/probe/{}" \; -exec touch "$w/probe/{}/$token" \;) || exit 1
mount -t overlay -o "ro,index=off,lowerdir=$up:$w/probe" dsec-probe "$w/view" || exit 1
(cd "$w/view" && find . -name "$token" -print0) >"$w/visible"
rc=$?
umount "$w/view"
exit $rc
