"""`python -m serve_app ...` is the `tensorfold` command."""

import sys

from serve_app.cli import main

sys.exit(main())
