import sys

from otel_straggler.cli import main

sys.exit(main())
