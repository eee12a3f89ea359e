import sys

from mmyatt.cli import main

sys.exit(main())
