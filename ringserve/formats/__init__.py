"""Model formats: chat templates, output parsers and family detection (sans-I/O)."""
