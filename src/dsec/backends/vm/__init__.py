"""VM sandboxes on QEMU: the layer both kinds share (QMP, guest agent, kernel and initramfs) and
the two backends, ``MicroVMBackend`` (kind ``microvm``) and ``FullVMBackend`` (kind ``fullvm``)."""
