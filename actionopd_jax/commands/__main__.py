"""`python -m actionopd_jax.commands ...` = the `actionopd` console script."""

import sys

from actionopd_jax.commands.main import main

sys.exit(main())
