import sys

from offload.cli import main

sys.exit(main())
