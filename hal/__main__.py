from hal.cli import main

raise SystemExit(main())
