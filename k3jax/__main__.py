"""`python -m k3jax ...` is the `k3jax` console script."""

import sys

from k3jax.cli import main

sys.exit(main())
