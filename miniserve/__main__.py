import sys

from miniserve.cli import main

sys.exit(main())
