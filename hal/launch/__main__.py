import sys

from hal.launch.generate import main

sys.exit(main())
