"""The tests' GlusterFS volume: ``dsec_bench.gluster``, which ``dsec bench layercache`` runs too."""

from dsec_bench.gluster import INSTALL_HINT, PING_TIMEOUT_S, GlusterVolume, missing  # noqa: F401
