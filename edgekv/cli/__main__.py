import sys

from edgekv.cli import main

sys.exit(main())
