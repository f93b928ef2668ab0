from t5forge.cli import main

raise SystemExit(main())
