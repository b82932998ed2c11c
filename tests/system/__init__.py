"""System tests: systemd, pip/venv builds, crash loops and kill -9, the slow lane."""
