"""Built-in models."""
