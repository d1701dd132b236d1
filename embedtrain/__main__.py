import sys

from embedtrain.cli import main

sys.exit(main())
