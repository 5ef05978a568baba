"""The HTTP API's shared ground (contract §2.1–2.2): what every endpoint reads and answers.

Every answer, success or failure, is an envelope; no FastAPI 422, no HTML, no stack trace.

- ``ids``: what an id (and config text) may hold, the ``Id`` type, ``printable``.
- ``json_body``: the body limits (64 KiB, nesting, NaN/Infinity, UTF-8) and ``parse_body``.
- ``request``: the request envelope models, ``read_envelope``, ``validate_as``, the request
  id that every later error echoes.
- ``answers``: ``ok`` and ``failure``, the answer envelopes.
- ``openapi``: the documented responses and the completion of the generated schema.
- ``error_handlers``: exceptions → failure envelopes, ``GuardMiddleware`` (body size, last
  resort 500) and ``install``, which wires it all into an app.

The modules import nothing of session_manager or resource_manager (``lint-imports``).
"""
