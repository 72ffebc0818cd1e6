"""FnCall: isolated stateless calls from a warm pool of locked-down containers.

``pool`` (the node's pool and its sizing), ``worker`` (one container and its zygote),
``backend`` (the worker container's shape) and ``zygote`` (the script that runs inside).
"""

from .pool import FnCallConfig, FnCallPool

__all__ = ["FnCallConfig", "FnCallPool"]
