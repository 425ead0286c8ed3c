import sys

from services.cli import main

sys.exit(main(["peer-agent", *sys.argv[1:]]))
