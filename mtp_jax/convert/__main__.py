"""python -m mtp_jax.convert meta|deepseek|to-hf|from-hf ... (see mtp_jax/convert/__init__.py)."""

import sys

from mtp_jax.convert.command import main

sys.exit(main())
