import sys

from cpcache.daemon.main import main

sys.exit(main())
