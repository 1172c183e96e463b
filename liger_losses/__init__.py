"""liger-losses: chunked fused-linear post-training losses and Triton kernels.

Public names are re-exported here; nothing else lives in this file.
"""

__version__ = "0.1.0"
