"""``python -m cupynce``: the report (see :mod:`cupynce.report.cli`)."""
import sys

from cupynce.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
