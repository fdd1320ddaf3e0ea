"""`torchrun ... -m upipe.train [options]`: the same options as `upipe train`."""

import sys

from upipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
