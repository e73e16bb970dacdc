from __future__ import annotations

from cluster.cli import main

raise SystemExit(main())
