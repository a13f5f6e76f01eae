import sys

from zpd.ops.cli import main

sys.exit(main())
