import sys

from spotguard.ops.cli import main

sys.exit(main())
