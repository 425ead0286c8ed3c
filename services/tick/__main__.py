import sys

from services.cli import main

sys.exit(main(["tick", *sys.argv[1:]]))
