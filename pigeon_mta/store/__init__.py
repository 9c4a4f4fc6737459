"""The store: every SQL statement pigeon-mta runs lives in this package, each in a named function."""
