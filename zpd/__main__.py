import sys

from zpd.cli import main

sys.exit(main())
