import sys

from miniserve.cli.main import main

sys.exit(main())
