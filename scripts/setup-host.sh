#!/usr/bin/env bash
# Install what DSec needs on a Debian host (as root), idempotently.
set -euo pipefail

PACKAGES=(crun gcc libc6-dev erofs-utils busybox-static debootstrap podman uidmap
          iproute2 nftables python3 python3-venv python3-pip psmisc ca-certificates
          qemu-system-x86 qemu-utils e2fsprogs bubblewrap
          gcc libc6-dev libseccomp2  # dsec-jail is compiled on first use; its seccomp program made with libseccomp
          postgresql  # initdb and postgres: the tests run a server of their own for `dsec serve --db`
          util-linux-extra procps kmod git  # fincore (page-cache checks), ps, modprobe zram; git for clones
          chromium    # headless, for the dashboard's test (tests/integration/test_dashboard.py)
          skopeo buildah  # dsec image pull (a registry) and dsec image build --dockerfile
          docker-registry  # a registry on loopback for their tests (tests/images/test_registry.py)
          glusterfs-server glusterfs-client  # the layer store on a distributed filesystem (tests/cluster/test_gluster_store.py)
          g++         # the C++ peer of dsec bench fncall's SandboxFusion arm
          tmux        # drives `dsec shell` as a person would (tests/integration/test_shell.py)
          lz4 zstd    # unpack the guest kernel once for a PVH boot (its payload: lz4 in 6.1, zstd from 6.12)
          docker.io)  # dockerd for Harbor's docker environment, the peer (dsec_bench.harbor_peer starts its own)

if [ "$(id -u)" != 0 ]; then
    echo "setup-host: run as root (DSec mounts layers and makes cgroups)" >&2
    exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-host: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The tests start a dockerd of their own (no bridge, no iptables rules); a system one, which
    # installing docker.io starts where systemd runs, would add docker0 and its NAT rules.
    if [[ " ${missing[*]} " == *" docker.io "* ]] && [ -d /run/systemd/system ]; then
        systemctl disable --now docker.service docker.socket >/dev/null 2>&1 || true
    fi
fi

# Hybrid cgroups (v1 controllers, hugetlb alone on the v2 tree): crun refuses to run until
# hugetlb is mounted on a v1 hierarchy. `dsec serve` does the same at start.
if [ ! -f /sys/fs/cgroup/cgroup.controllers ] && [ -f /sys/fs/cgroup/unified/cgroup.controllers ] \
   && grep -qw hugetlb /sys/fs/cgroup/unified/cgroup.controllers; then
    mkdir -p /sys/fs/cgroup/hugetlb
    mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb
    echo "setup-host: mounted the hugetlb controller on a v1 hierarchy (hybrid cgroups)"
fi

# Swap. Pausing a sandbox pushes its memory out to swap, and the cold-memory reclaimer does the
# same for idle pages. Two set-ups (DSEC_SETUP_SWAP):
# - zram (the default): swap compressed in RAM, half of RAM as zram-generator does; left alone
#   when a zram swap is already on, or when zram0 is taken for something else. Text comes back
#   about half; random bytes (hashes, compressed or encrypted buffers) do not come back at all.
# - disk: a swap file on disk (DSEC_SETUP_SWAP_FILE, default /var/lib/dsec/swapfile, of
#   DSEC_SETUP_SWAP_SIZE, default the size of RAM): what a node that pauses whole jobs wants, as
#   all of a paused sandbox's memory leaves RAM. A zram swap is turned off. zswap goes in front
#   of the file (a RAM pool of at most DSEC_SETUP_ZSWAP_POOL_PERCENT of RAM, default 20, for what
#   compresses) on cgroup v2, where DSec keeps paused sandboxes out of the pool
#   (memory.zswap.max 0) so the pool serves running sandboxes' cold pages. With the memory
#   controller on v1 (hybrid hosts) there is no such control and the pool would keep a paused
#   job's memory in RAM, so zswap stays off there unless DSEC_SETUP_ZSWAP=1.
swap_mode=${DSEC_SETUP_SWAP:-zram}
case "$swap_mode" in zram|disk) ;; *)
    echo "setup-host: DSEC_SETUP_SWAP='$swap_mode': use zram or disk" >&2; exit 1 ;;
esac
if [ "$swap_mode" = disk ]; then
    swap_file=${DSEC_SETUP_SWAP_FILE:-/var/lib/dsec/swapfile}
    if [ ! -e /sys/module/zswap/parameters/enabled ]; then
        echo "setup-host: this kernel has no zswap (CONFIG_ZSWAP); DSEC_SETUP_SWAP=disk needs it" >&2
        exit 1
    fi
    if ! grep -q "^$swap_file " /proc/swaps; then
        size=${DSEC_SETUP_SWAP_SIZE:-$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))M}
        mkdir -p "$(dirname "$swap_file")"
        if [ ! -f "$swap_file" ]; then
            fallocate -l "$size" "$swap_file" 2>/dev/null || dd if=/dev/zero of="$swap_file" bs=1M \
                count=$(( $(numfmt --from=iec "$size") >> 20 )) status=none
            chmod 600 "$swap_file"
            mkswap "$swap_file" >/dev/null
        fi
        swapon -p 50 "$swap_file"
        echo "setup-host: swap file $swap_file ($(du -h --apparent-size "$swap_file" | cut -f1))"
    fi
    for dev in $(awk '/^\/dev\/zram/ {print $1}' /proc/swaps); do
        swapoff "$dev" && echo "setup-host: zram swap $dev off (zswap is in front of the swap file)"
    done
    zswap=${DSEC_SETUP_ZSWAP:-}
    if [ -z "$zswap" ]; then
        if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
            zswap=1
        else
            zswap=0
        fi
    fi
    if [ "$zswap" = 1 ]; then
        echo 1 > /sys/module/zswap/parameters/enabled
        echo "${DSEC_SETUP_ZSWAP_POOL_PERCENT:-20}" > /sys/module/zswap/parameters/max_pool_percent
        for algorithm in zstd lz4 lzo-rle lzo; do
            if echo "$algorithm" > /sys/module/zswap/parameters/compressor 2>/dev/null; then break; fi
        done
        echo "setup-host: zswap on ($(cat /sys/module/zswap/parameters/compressor)," \
             "pool at most $(cat /sys/module/zswap/parameters/max_pool_percent)% of RAM)"
    else
        echo N > /sys/module/zswap/parameters/enabled
        echo "setup-host: zswap off (memory controller on cgroup v1: its pool would keep paused" \
             "sandboxes' memory in RAM; DSEC_SETUP_ZSWAP=1 turns it on)"
    fi
elif ! grep -q '^/dev/zram' /proc/swaps; then
    if ! modprobe zram 2>/tmp/dsec-modprobe.err && [ ! -e /sys/class/zram-control ]; then
        if [ "${DSEC_SETUP_NO_ZRAM:-0}" != 1 ]; then
            echo "setup-host: cannot load the zram module ($(cat /tmp/dsec-modprobe.err)). A paused sandbox's memory" \
                 "goes out to zram swap, and the tests of it need it: install this kernel's modules" \
                 "(linux-image-$(uname -r) or linux-modules-extra-$(uname -r)), or set DSEC_SETUP_NO_ZRAM=1" \
                 "to set up without it (pause then cannot push memory out)" >&2
            exit 1
        fi
        echo "setup-host: no zram (DSEC_SETUP_NO_ZRAM=1): pause cannot push memory out" >&2
    fi
    if [ ! -e /sys/block/zram0 ] && [ -e /sys/class/zram-control/hot_add ]; then
        cat /sys/class/zram-control/hot_add >/dev/null
    fi
    if [ -e /sys/block/zram0 ] && [ "$(cat /sys/block/zram0/disksize)" = 0 ]; then
        half=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024 / 2 ))
        echo "$half" > /sys/block/zram0/disksize
        mkswap /dev/zram0 >/dev/null
        swapon -p 100 /dev/zram0
        echo "setup-host: swap on /dev/zram0 ($(( half >> 20 )) MiB, $(sed 's/.*\[\(.*\)\].*/\1/' /sys/block/zram0/comp_algorithm))"
    elif [ -e /sys/block/zram0 ]; then
        echo "setup-host: /dev/zram0 is in use for something else; no zram swap (pause cannot push memory out)" >&2
    fi
fi
