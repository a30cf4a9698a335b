import sys

from vericache.cli import main

sys.exit(main())
