"""dlm.runtime: the MLX runtime (models, generation, API, CLI, server).

Importing it first loads an optimized BLAS for MLX's CPU backend on Linux
(``dlm.runtime.blas``), before anything imports MLX.
"""

from . import blas as _blas

_blas.use_optimized_blas()
