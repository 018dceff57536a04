import sys

from nightjar.cli import main

if __name__ == "__main__":
    sys.exit(main())
