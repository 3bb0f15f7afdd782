"""dlm.runtime: the MLX runtime (models, generation, API, CLI, server).

Importing it first loads an optimized BLAS for MLX's CPU backend on Linux
(``dlm.runtime.platform.blas``), before anything imports MLX, and keeps float32 matrix
products in full float32 on GPUs (``dlm.runtime.platform.precision``); a Linux MLX
without its backend library fails with one line on what to install
(``dlm.runtime.platform.backend``).
"""

from .platform import backend as _backend
from .platform import blas as _blas
from .platform import files as _files
from .platform import precision as _precision

_files.hold_standard_fds()  # a closed stdin's fd 0 handed to a model file makes MLX fail to read it
_blas.use_optimized_blas()
_precision.use_full_float32()
_backend.require()  # MLX itself, or one line on the backend to install (Linux)
