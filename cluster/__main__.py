from cluster.cli import main

raise SystemExit(main())
