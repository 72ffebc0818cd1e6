"""dsec: the DSec platform (apiserver, edge, backends, images). The SDK is ``libdsec``."""

__version__ = "0.1.0"
