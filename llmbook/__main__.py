"""``python -m llmbook``: see :mod:`llmbook.cli`."""

import sys

from llmbook.cli import main

if __name__ == "__main__":
    sys.exit(main())
