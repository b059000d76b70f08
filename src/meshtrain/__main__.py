import sys

from meshtrain.cli.main import main

sys.exit(main())
