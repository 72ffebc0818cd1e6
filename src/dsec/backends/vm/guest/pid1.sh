# PID 1 after switch_root when the image brings no init of its own: runs the agent, reaps
# orphans (wait reaps any child), and powers off when the agent is gone, so that the VM and its
# QEMU end with it.
export PATH=/dev/.dsec/bin
hostname sandbox 2>/dev/null
/dev/.dsec/agent &
wait $!
echo "dsec: guest agent exited" >/dev/ttyS0
poweroff -f
