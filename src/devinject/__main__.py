import sys

from devinject.entry import main

sys.exit(main())
