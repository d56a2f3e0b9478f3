import sys

from qvisor.factory.server import main

sys.exit(main())
