import sys

from zmrl.cli import main

sys.exit(main())
