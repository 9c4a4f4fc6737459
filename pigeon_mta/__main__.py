"""`python -m pigeon_mta`: the same as the `pigeon-mta` command."""

from pigeon_mta.cli import main

raise SystemExit(main())
