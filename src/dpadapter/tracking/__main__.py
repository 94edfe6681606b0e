"""`python -m dpadapter.tracking CONFIG [--serve] [--port N]` (`make mlflow`)."""

from dpadapter.tracking.ui import main

raise SystemExit(main())
