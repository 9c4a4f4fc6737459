"""The admin and service commands behind `pigeon-mta`: one module per area, each with `register`."""
