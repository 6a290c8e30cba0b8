from flashdraft.cli import main

raise SystemExit(main())
