"""Pipeline glue between the engine and the executor (pipe.py); the rest of what lived here
moved to places named for what they hold (docs/architecture.md)."""
