#!/bin/busybox sh
# PID 1 of every DSec VM, in the initramfs. Loads the modules, builds the root filesystem, puts
# the guest agent (dsec-agent, with busybox and pack.sh) on a tmpfs at <root>/dev/.dsec and hands over:
#   dsec.mode=microvm  root = overlay of the EROFS layers (pmem with DAX, or virtio-blk when
#                      dsec.layerdev=vd) under a tmpfs upper; PID 1 becomes pid1.sh (the agent)
#   dsec.mode=fullvm   root = overlay of /dev/vda (the image's ext4 disk, read-only, shared by
#                      every VM of the image) under an upper on /dev/vdb (the VM's own ext4
#                      disk); PID 1 becomes the image's own /sbin/init, which starts the agent
#                      (a busybox init's inittab, or systemd's dsec-agent.service, says so)
# Either way the upper's filesystem is moved to <root>/dev/.dsec/rw, where the agent packs it.
/bin/busybox mkdir -p /bin /proc /sys /dev /newroot /layers /rw
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {
    echo "dsec-init: $*" >/dev/ttyS0
    poweroff -f
}

for m in $(cat /lib/modules/load); do
    insmod "/lib/modules/$m.ko" 2>/dev/null
done

mode=microvm layers=0 layerdev=pmem
for arg in $(cat /proc/cmdline); do
    case $arg in
        dsec.mode=*) mode=${arg#*=} ;;
        dsec.layers=*) layers=${arg#*=} ;;
        dsec.layerdev=*) layerdev=${arg#*=} ;;
    esac
done

if [ "$mode" = probe ]; then
    echo dsec-probe-ok >/dev/ttyS0
    poweroff -f
fi

wait_dev() {
    n=0
    while [ ! -e "$1" ]; do
        usleep 10000
        n=$((n + 1))
        [ $n -gt 1000 ] && fail "no device $1"
    done
}

if [ "$mode" = fullvm ]; then
    wait_dev /dev/vda
    wait_dev /dev/vdb
    mkdir -p /base
    mount -t ext4 -o ro,noload /dev/vda /base || fail "cannot mount the image disk"
    mount -t ext4 /dev/vdb /rw || fail "cannot mount the VM's own disk"
    mkdir -p /rw/upper /rw/work
    mount -t overlay -o "lowerdir=/base,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot \
        || fail "cannot mount the overlay"
else
    lower=
    i=0
    set -- a b c d e f g h i j k l m n o p
    while [ $i -lt "$layers" ]; do
        if [ "$layerdev" = vd ]; then
            dev=/dev/vd$1
            opts=ro
            shift
        else
            dev=/dev/pmem$i
            opts=ro,dax=always
        fi
        wait_dev $dev
        mkdir -p /layers/$i
        mount -t erofs -o $opts $dev /layers/$i || fail "cannot mount layer $i from $dev"
        lower=/layers/$i${lower:+:$lower}
        i=$((i + 1))
    done
    mount -t tmpfs -o mode=0755 rw /rw
    mkdir -p /rw/upper /rw/work
    mount -t overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot \
        || fail "cannot mount the overlay"
fi

mkdir -p /newroot/proc /newroot/sys /newroot/dev /newroot/tmp
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mkdir -p /newroot/dev/.dsec
mount -t tmpfs -o mode=0700 dsec /newroot/dev/.dsec
mkdir /newroot/dev/.dsec/rw
mount --move /rw /newroot/dev/.dsec/rw
mkdir -p /newroot/dev/.dsec/bin /newroot/dev/pts /newroot/dev/shm
cp /bin/busybox /dsec/agent /dsec/pack.sh /dsec/pid1.sh /dsec/jail /dsec/seccomp.bpf /dsec/caps /newroot/dev/.dsec/
# One busybox run in the new root makes every applet's link to /dev/.dsec/busybox (its own
# path there): one process, where a link each (269 of them) took a second of a boot under TCG.
chroot /newroot /dev/.dsec/busybox --install -s /dev/.dsec/bin
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup 2>/dev/null

# /sbin/init may be an absolute symlink (Debian's to /lib/systemd/systemd): not -x from here.
if [ "$mode" = fullvm ] && { [ -x /newroot/sbin/init ] || [ -L /newroot/sbin/init ]; } && { grep -q dsec /newroot/etc/inittab 2>/dev/null \
        || [ -e /newroot/etc/systemd/system/dsec-agent.service ]; }; then
    exec switch_root /newroot /sbin/init
fi
exec switch_root /newroot /dev/.dsec/busybox sh /dev/.dsec/pid1.sh
