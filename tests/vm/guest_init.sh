#!/bin/sh
# The cgroup v2 lane's guest init (tests/vm/lane.py boots it as the initramfs's /init).
#
# stage 1, PID 1 in the initramfs: load the 9p/virtio/overlay modules, mount the host's / (9p tag
# "hostroot", read-only) under an overlay whose upper layer is tmpfs, so the guest may write
# anywhere and the host sees nothing of it; mount the results share (9p tag "results", the host's
# temporary directory, read-write) at /.quark-vm/results, and the "pair" share two guests have in
# common (tests/vm/pair.py) at /.quark-vm/pair where there is one; switch_root into the overlay.
# stage 2, PID 1 in the host's tree: mount what a booted Debian 12 has (proc, sys, a cgroup2-only
# /sys/fs/cgroup as systemd mounts it, dev with kmod's static nodes, pts, shm, mqueue, fresh /run
# and /tmp), bring lo up, run the host's results/run.sh (cd to the checkout, pytest), keep its
# output and status in the results share, power off.
VM=/.quark-vm
RES=$VM/results

stage1() {
    export PATH=/bin
    /bin/busybox --install -s /bin
    mount -t proc proc /proc
    mount -t sysfs sysfs /sys
    mount -t devtmpfs devtmpfs /dev
    while read -r m; do
        insmod "/lib/modules/$m" || die "insmod $m failed"
    done < /modules.list
    opts=trans=virtio,version=9p2000.L,msize=512000
    # cache=loose: the host's tree does not change under a run, and uncached 9p lookups are slow
    mount -t 9p -o "$opts,ro,cache=loose" hostroot /lower || die "mounting the host's / (9p) failed"
    mount -t tmpfs -o mode=755 upper /upper
    mkdir /upper/data /upper/work
    mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot \
        || die "overlay over the 9p root failed"
    mkdir -p /newroot$RES
    mount -t 9p -o "$opts,cache=none" results /newroot$RES || die "mounting the results share (9p) failed"
    # the two guests of tests/vm/pair.py share one more directory ("pair"); a lone guest has none
    mkdir -p /newroot$VM/pair
    mount -t 9p -o "$opts,cache=none" pair /newroot$VM/pair 2>/dev/null || rmdir /newroot$VM/pair
    # stage 2's own busybox and script: the host's /bin/busybox is not needed
    cp /bin/busybox /init /static-nodes /newroot$VM/
    umount /proc /sys /dev
    exec switch_root /newroot $VM/busybox sh $VM/init stage2
}

# a fresh tmpfs on $1 that still shows the paths in $RES/keep beneath it (a checkout in /tmp)
fresh_tmpfs() {
    n=0
    while read -r p; do
        case "$p" in "$1"/*)
            n=$((n + 1))
            mkdir -p "$VM/keep/$n" && mount --bind "$p" "$VM/keep/$n";;
        esac
    done < $RES/keep
    mount -t tmpfs -o mode=1777 tmpfs "$1"
    [ "$1" = /run ] && chmod 755 /run
    n=0
    while read -r p; do
        case "$p" in "$1"/*)
            n=$((n + 1))
            mkdir -p "$p" && mount --move "$VM/keep/$n" "$p";;
        esac
    done < $RES/keep
}

stage2() {
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
    bb=$VM/busybox
    $bb mount -t proc proc /proc
    $bb mount -t sysfs sysfs /sys
    # unified only (the kernel is booted with cgroup_no_v1=all), with systemd's options
    $bb mount -t cgroup2 -o nsdelegate,memory_recursiveprot cgroup2 /sys/fs/cgroup \
        || die "mounting cgroup2 failed"
    $bb mount -t bpf bpf /sys/fs/bpf
    $bb mount -t devtmpfs devtmpfs /dev
    $bb mkdir -p /dev/pts /dev/shm /dev/mqueue
    $bb mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts /dev/pts
    $bb ln -sf pts/ptmx /dev/ptmx
    $bb mount -t tmpfs -o mode=1777 shm /dev/shm
    $bb mount -t mqueue mqueue /dev/mqueue
    # kmod static-nodes, as systemd-tmpfiles runs it at boot: opening /dev/fuse loads fuse
    while read -r kind mode major minor path; do
        $bb mkdir -p "$($bb dirname "/dev/$path")"
        [ -e "/dev/$path" ] || $bb mknod -m "$mode" "/dev/$path" "$kind" "$major" "$minor"
    done < $VM/static-nodes
    $bb ln -sf /proc/self/fd /dev/fd
    $bb ln -sf /proc/self/fd/0 /dev/stdin
    $bb ln -sf /proc/self/fd/1 /dev/stdout
    $bb ln -sf /proc/self/fd/2 /dev/stderr
    fresh_tmpfs /run
    fresh_tmpfs /tmp
    if [ -f $RES/hostname ]; then $bb hostname "$($bb cat $RES/hostname)"; else $bb hostname quark-vm; fi
    $bb ip link set lo up
    # modules beyond the initramfs's (veth, bridge, netfilter, ...) load on demand from the
    # unpacked package, through busybox's modprobe
    kmods=$($bb cat $RES/modules)
    $bb mkdir -p "/lib/modules/$($bb uname -r)"
    $bb mount --bind "$kmods" "/lib/modules/$($bb uname -r)"
    $bb ln -sf busybox $VM/modprobe
    echo $VM/modprobe > /proc/sys/kernel/modprobe
    echo "quark-vm: $($bb uname -r) up in $($bb cut -d' ' -f1 /proc/uptime) s (guest clock); running $RES/run.sh"
    # stdin from /dev/null; output to the console (the host's stdout) and to the results share
    ( $bb sh $RES/run.sh </dev/null 2>&1; echo $? > $RES/status.tmp ) | $bb tee $RES/output.log
    $bb dmesg > $RES/dmesg.log
    $bb mv $RES/status.tmp $RES/status
    $bb sync
    $bb poweroff -f
}

die() {
    echo "quark-vm: $*"
    [ -d $RES ] && echo "$*" > $RES/guest-error
    # dies as PID 1: the kernel panics, panic=-1 reboots, and qemu -no-reboot exits
    /bin/busybox poweroff -f 2>/dev/null || $VM/busybox poweroff -f
    exit 1
}

case "${1:-stage1}" in
    stage2) stage2 ;;
    *) stage1 ;;
esac
