# The DSec guest agent: serves the host over the virtio-serial port named "dsec.agent".
#
# Frames. Host to guest: one header line "ID OP ARG…" then the payloads the header announces,
# by byte length. Guest to host: "ID ok LEN" + LEN bytes, "ID err CODE LEN" + LEN bytes of
# message, or "ID done RC OUTLEN OUTTOTAL ERRLEN ERRTOTAL" + stdout + stderr.
#   ping                                  -> ok 0
#   exec CAP WDLEN SCRIPTLEN STDINLEN     payloads: workdir, script, stdin (STDINLEN -1: none)
#                                         -> done … when the command ends (answers may come
#                                            in any order: commands run side by side)
#   kill JOBID                            -> ok 0; the job's command and all it started die
#   read PATHLEN MAX                      -> ok LEN + the file, or err enoent|invalid
#   write PATHLEN DATALEN MODE UID GID    -> ok 0 or err invalid
#   mkdir PATHLEN UID GID                 -> ok 0 or err invalid
#   shutdown                              -> ok 0, then the VM powers off
#   pack TOKEN                            -> "ID part LEN" + LEN bytes, repeated: a tar of the
#                                            root's writable layer (/dev/.dsec/rw/upper), taken
#                                            with the commands' cgroups frozen; then ok LEN + the
#                                            NUL-separated paths of a probe file named TOKEN that
#                                            stays visible (the host finds opaque dirs from them)
# Each command runs in a cgroup of its own (so a kill takes everything it started), with its
# output captured up to CAP bytes a stream and the rest counted.
#
# Each command runs confined by dsec-jail (the sandbox capability set, no_new_privs, the sandbox
# seccomp profile, Landlock) in the sandbox's pid namespace, and without the channel's fd: it
# sees the processes of the sandbox's commands but cannot see or signal this agent, and cannot
# open the port, this directory (other commands' scripts, input and output) or any device but
# the usual few; /proc and /sys are read-only to it.
export PATH=/dev/.dsec/bin
D=/dev/.dsec
CG=/sys/fs/cgroup/dsec
mkdir -p $D/j $CG
# The guest kernel's log is the sandbox's own: commands may read it (dmesg) without CAP_SYSLOG.
echo 0 >/proc/sys/kernel/dmesg_restrict
# The sandbox's pid namespace: its init (which only reaps) stays as long as the VM. In the
# commands' mount namespace this directory is read-only too (Landlock ABI 2 cannot stop a
# truncate(2) of a hidden file).
init=$($D/jail --ro $D --init) || { echo "dsec-agent: no pid namespace for commands" >/dev/ttyS0; exit 1; }
JAIL="$D/jail --join $init --caps $(cat $D/caps) --seccomp $D/seccomp.bpf --ro /proc --ro /sys --hide /dev"
for dev in null zero full random urandom tty ptmx pts shm; do
    JAIL="$JAIL --rw /dev/$dev"
done
JAIL="$JAIL --ro $D/busybox"

port=
for n in /sys/class/virtio-ports/*/name; do
    if [ "$(cat "$n")" = dsec.agent ]; then
        port=${n%/name}
        port=/dev/${port##*/}
    fi
done
[ -n "$port" ] || { echo "dsec-agent: no dsec.agent port" >/dev/ttyS0; exit 1; }
exec 3<>"$port"

size() { stat -c %s "$1" 2>/dev/null || echo 0; }

# Frames from concurrent jobs must not interleave: a mkdir lock around each.
send() {
    hdr=$1
    shift
    until mkdir $D/lock 2>/dev/null; do usleep 1000; done
    { echo "$hdr"; [ $# -gt 0 ] && cat "$@"; } >&3
    rmdir $D/lock
}

fail() {  # ID CODE MESSAGE
    printf %s "$3" >$D/msg.$1
    send "$1 err $2 $(size $D/msg.$1)" $D/msg.$1
    rm -f $D/msg.$1
}

# take N FILE: exactly N bytes from the port into FILE.
take() {
    if [ "$1" -gt 0 ]; then
        dd bs=65536 count="$1" iflag=count_bytes,fullblock of="$2" <&3 2>/dev/null
    else
        : >"$2"
    fi
}

# capture FILE CAP: keep the first CAP bytes of stdin in FILE, count the rest in FILE.rest.
capture() {
    read -r pid _ </proc/self/stat
    echo "$pid" >"$CG/$job-io/cgroup.procs"
    if [ "$2" -gt 0 ]; then
        dd bs=65536 count="$2" iflag=count_bytes,fullblock of="$1" 2>/dev/null
    else
        : >"$1"
    fi
    wc -c >"$1.rest"
}

run_job() {  # JOBID CAP
    job=$1
    j=$D/j/$job
    mkdir $CG/$job $CG/$job-io
    mkfifo $j/op $j/ep
    capture $j/out "$2" <$j/op 3>&- &
    capture $j/err "$2" <$j/ep 3>&- &
    (
        read -r pid _ </proc/self/stat
        echo "$pid" >"$CG/$job/cgroup.procs"
        exec $JAIL -- $D/busybox sh -c "$(cat $j/script)"
    ) <$j/in >$j/op 2>$j/ep 3>&-
    rc=$?
    # Output left in the pipes is read at once; a background process that keeps them open is
    # not waited for (half a second at most).
    n=0
    while [ $n -lt 10 ] && ! { [ -s $j/out.rest ] && [ -s $j/err.rest ]; }; do
        usleep 50000
        n=$((n + 1))
    done
    echo 1 >$CG/$job-io/cgroup.kill 2>/dev/null
    ot=$(( $(size $j/out) + $(cat $j/out.rest 2>/dev/null || echo 0) ))
    et=$(( $(size $j/err) + $(cat $j/err.rest 2>/dev/null || echo 0) ))
    send "$job done $rc $(size $j/out) $ot $(size $j/err) $et" $j/out $j/err
    rm -rf $j
    rmdir $CG/$job-io $CG/$job 2>/dev/null
}

do_read() {  # ID PATH MAX
    if [ ! -e "$2" ]; then
        fail "$1" enoent "no such file in sandbox: $2"
    elif [ -d "$2" ]; then
        fail "$1" invalid "cannot read $2: is a directory"
    elif [ ! -f "$2" ]; then
        fail "$1" invalid "cannot read $2: not a regular file"
    elif [ "$(size "$2")" -gt "$3" ]; then
        fail "$1" invalid "cannot read $2: $(size "$2") bytes is over the $3-byte limit"
    elif ! cat "$2" >$D/data.$1 2>/dev/null; then
        fail "$1" invalid "cannot read $2: permission denied"
    else
        send "$1 ok $(size $D/data.$1)" $D/data.$1
    fi
    rm -f $D/data.$1
}

# makedirs DIR UID GID: create the missing directories of DIR, owned by UID:GID.
makedirs() {
    [ -d "$1" ] && return 0
    [ -e "$1" ] && return 1
    makedirs "$(dirname "$1")" "$2" "$3" || return 1
    mkdir "$1" 2>/dev/null && chown "$2:$3" "$1"
    [ -d "$1" ]
}

do_write() {  # ID PATH DATAFILE MODE UID GID (a file that exists keeps its owner)
    dir=$(dirname "$2")
    existed=
    [ -e "$2" ] && existed=1
    if ! makedirs "$dir" "$5" "$6"; then
        fail "$1" invalid "cannot write $2: cannot create directory $dir"
    elif [ -d "$2" ]; then
        fail "$1" invalid "cannot write $2: Is a directory"
    elif ! cat "$3" >"$2" 2>/dev/null; then
        fail "$1" invalid "cannot write $2: cannot open the file"
    else
        { [ -n "$existed" ] || chown "$5:$6" "$2"; } && chmod "$4" "$2"
        send "$1 ok 0"
    fi
}

# The opaque-directory mark is an xattr, and busybox reads none: an overlay of the writable layer
# over a tree with a probe file TOKEN in each of its directories shows the probe under a
# directory unless that directory, or one above it, is opaque.
probe_visible() {  # UPPER WORKDIR TOKEN -> WORKDIR/visible
    mkdir -p "$2/probe" "$2/view"
    (cd "$1" && find . -type d -exec mkdir -p "$2/probe/{}" \; -exec touch "$2/probe/{}/$3" \;) || return 1
    mount -t overlay -o "ro,index=off,lowerdir=$1:$2/probe" dsec-probe "$2/view" || return 1
    (cd "$2/view" && find . -name "$3" -print0) >"$2/visible"
    rc=$?
    umount "$2/view"
    return $rc
}

do_pack() {  # ID TOKEN
    up=$D/rw/upper
    w=$D/pack.$1
    if [ ! -d $up ]; then
        fail "$1" invalid "this VM has no writable layer at $up"
        return
    fi
    mkdir -p $w
    frozen=
    for c in $CG/*/; do
        case $c in *-io/) continue ;; esac
        echo 1 >"${c}cgroup.freeze" 2>/dev/null && frozen="$frozen $c"
    done
    for c in $frozen; do
        n=0
        until grep -q '^frozen 1' "${c}cgroup.events" 2>/dev/null || [ $n -gt 100 ]; do
            usleep 20000
            n=$((n + 1))
        done
    done
    if probe_visible $up $w "$2"; then
        (cd $up && tar -c .) | while :; do
            dd bs=65536 count=16 iflag=fullblock of=$w/chunk 2>/dev/null
            n=$(size $w/chunk)
            [ "$n" -gt 0 ] || break
            send "$1 part $n" $w/chunk
            [ "$n" -eq 1048576 ] || break
        done
        send "$1 ok $(size $w/visible)" $w/visible
    else
        fail "$1" invalid "cannot look for opaque directories in $up"
    fi
    for c in $frozen; do echo 0 >"${c}cgroup.freeze" 2>/dev/null; done
    rm -rf $w
}

while :; do
    if ! read -r id op a b c d e <&3; then
        usleep 20000  # the host is not connected (yet, or any more: a restored VM waits here)
        continue
    fi
    case $op in
        ping)
            send "$id ok 0" ;;
        exec)  # CAP WDLEN SCRIPTLEN STDINLEN
            j=$D/j/$id
            mkdir -p $j
            take "$b" $j/wd
            take "$c" $j/script
            if [ "$d" -ge 0 ]; then take "$d" $j/in; else ln -s /dev/null $j/in; fi
            wd=$(cat $j/wd)
            if [ -d "$wd" ]; then
                ( run_job "$id" "$a" & )
            else
                rm -rf $j
                fail "$id" notdir "workdir $wd is not a directory in the sandbox"
            fi ;;
        kill)
            echo 1 >$CG/$a/cgroup.kill 2>/dev/null
            send "$id ok 0" ;;
        read)  # PATHLEN MAX
            take "$a" $D/path.$id
            p=$(cat $D/path.$id)
            rm -f $D/path.$id
            do_read "$id" "$p" "$b" ;;
        write)  # PATHLEN DATALEN MODE UID GID
            take "$a" $D/path.$id
            take "$b" $D/data.$id
            p=$(cat $D/path.$id)
            do_write "$id" "$p" $D/data.$id "$c" "$d" "$e"
            rm -f $D/path.$id $D/data.$id ;;
        mkdir)  # PATHLEN UID GID
            take "$a" $D/path.$id
            p=$(cat $D/path.$id)
            rm -f $D/path.$id
            if makedirs "$p" "$b" "$c"; then send "$id ok 0"; else fail "$id" invalid "cannot create directory $p"; fi ;;
        pack)  # TOKEN
            ( do_pack "$id" "$a" & ) ;;
        shutdown)
            send "$id ok 0"
            sync
            poweroff -f ;;
        *)
            fail "$id" invalid "unknown operation $op" ;;
    esac
done
