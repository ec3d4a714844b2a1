"""Between cases and backends: the backend protocol, kernel-call statements, tolerances, the
comparison, backends by name."""
