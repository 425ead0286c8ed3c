import sys

from irisfed.services.common.startup import main

sys.exit(main("tick"))
