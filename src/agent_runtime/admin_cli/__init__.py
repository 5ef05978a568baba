"""``agent-runtime admin …``: the operators' command line over a running service's admin API
(HTTP, the admin token), tables for people and ``--json`` for scripts, as ``kubectl get`` does.

``client.py`` speaks HTTP (bounded in time and size, every failure a typed error),
``output.py`` draws tables and key/value blocks, ``commands.py`` holds the argument parser and
what each command asks and shows. Nothing here imports the service's floors: the CLI is a
client of the HTTP API (docs/reference/api.md), as any other operator tool would be.
"""
