"""Session manager: the HTTP handlers, sticky placement, the wait queue and the config layer."""
