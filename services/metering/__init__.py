"""The metering service: USAGE events into an idempotent ledger (SQLite or PostgreSQL), usage queries."""
