import sys

from irisfed.cli import main

sys.exit(main())
