"""MiniServeLM web app: `python app.py [--help]` (the same as `miniserve app`)."""

import sys

from miniserve.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
