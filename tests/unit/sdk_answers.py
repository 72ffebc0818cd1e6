"""What the SDK tests' stand-in servers answer: one sandbox's info, and the args that made it."""

from libdsec import DSecContainerRunArgs

INFO = {
    "id": "n0-0123456789abcdef", "node": "n0", "image": "busybox", "status": "running",
    "created_at": "2026-01-01T00:00:00Z", "last_active_at": "2026-01-01T00:00:00Z",
    "memory_limit_mb": 64, "cpu_cores_limit": 1.0, "ttl_running_stop": 60.0,
    "init_user": "root", "workdir": "/",
}
ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)
