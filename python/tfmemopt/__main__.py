import sys

from tfmemopt.cli import main

sys.exit(main())
