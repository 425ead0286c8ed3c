import sys

from services.common.startup import main

sys.exit(main("web"))
