import sys

from dpadapter.cli import main

sys.exit(main())
