"""The SQL configuration store: tables, the async-safe engine wrapper, schema migrations."""
