"""runtime_handlers."""
