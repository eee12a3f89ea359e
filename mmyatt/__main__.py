import sys

from mmyatt.cli.main import main

sys.exit(main())
