"""`rimuru` from a source tree without an install (with tools/device_env.sh): python tools/cli.py profile ..."""

import sys

from rimuru.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
